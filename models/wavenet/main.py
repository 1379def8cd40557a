r"""Command line: train, or sample from a trained checkpoint.

    python -m models.wavenet.main train --config small --workdir workdir/wavenet-small
    python -m models.wavenet.main sample --config small --workdir workdir/wavenet-small \
        --seconds 2 --sampler fused
    python -m models.wavenet.main sample --config small --workdir workdir/wavenet-small \
        --seconds 2 --sampler layer_sharded_fused --stages 4 --streams 4

The layer-sharded samplers place the layers on `--stages` devices (on CPU, that many host
devices of this process), handing activations on with jaxring's point-to-point transfers.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import time
import typing
from pathlib import Path

from models.wavenet.configs import NAMES as CONFIG_NAMES

COMMANDS = ("train", "sample")
SAMPLERS = ("naive", "incremental", "python_loop", "fused", "fused_f16", "layer_sharded",
            "layer_sharded_fused")


def apply_overrides(config, pairs: list[str]):
    """`config` with each FIELD=VALUE of `pairs` set, VALUE a Python literal (else a string) of
    the field's kind. A value of another kind (num_epochs=three) was saved in config.json and
    failed every later resume; an unknown field failed with dataclasses' message."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    types = typing.get_type_hints(type(config))  # declared: a stored config may hold 1 for 1.0
    overrides = {}
    for pair in pairs:
        key, equals, text = pair.partition("=")
        if not equals or key not in fields or dataclasses.is_dataclass(fields[key]):
            known = ", ".join(k for k, v in fields.items() if not dataclasses.is_dataclass(v))
            raise SystemExit(f"--set {pair}: takes FIELD=VALUE for one of {known}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        kind = types[key]
        if kind is float and type(value) is int:
            value = float(value)
        if type(value) is not kind:
            raise SystemExit(f"--set {pair}: {key} takes a value of type {kind.__name__} (it is "
                             f"{fields[key]!r})")
        overrides[key] = value
    return dataclasses.replace(config, **overrides)


def sample_command(config, args) -> None:
    import jax
    import jax.numpy as jnp

    if args.sampler.startswith("layer_sharded") and jax.config.jax_platforms in (None, "", "cpu"):
        try:
            jax.config.update("jax_num_cpu_devices", args.stages)
        except RuntimeError:  # jax has started (a caller's process): its devices as they are
            pass

    from models.wavenet import audio, fused_sampler, pipeline_sampler, sampler, train

    weights = train.load_weights(args.workdir, config)
    num_samples = int(args.seconds * config.sample_rate)
    key = jax.random.key(args.seed)

    if args.sampler.startswith("layer_sharded"):
        if len(jax.devices()) < args.stages:
            raise SystemExit(f"--stages {args.stages}: this process has {len(jax.devices())} "
                             "devices")
        stages = jax.make_mesh((args.stages,), ("stage",), devices=jax.devices()[:args.stages])
        # Restored onto one device; the samplers place each stage's share themselves.
        weights = jax.device_put(weights, jax.NamedSharding(stages, jax.P()))
    run = {
        "naive": lambda: sampler.sample_naive(weights, config.model, key, num_samples,
                                              args.streams),
        "incremental": lambda: sampler.sample_incremental(weights, config.model, key,
                                                          num_samples, args.streams),
        "python_loop": lambda: sampler.sample_python_loop(weights, config.model, key,
                                                          num_samples, args.streams),
        "fused": lambda: fused_sampler.sample_fused(weights, config.model, key, num_samples,
                                                    args.streams),
        "fused_f16": lambda: fused_sampler.sample_fused(weights, config.model, key, num_samples,
                                                        args.streams, weight_dtype=jnp.float16),
        "layer_sharded": lambda: pipeline_sampler.sample_layer_sharded(
            weights, config.model, key, num_samples, args.streams, stages, "stage"),
        "layer_sharded_fused": lambda: pipeline_sampler.sample_layer_sharded_fused(
            weights, config.model, key, num_samples, args.streams, stages, "stage"),
    }[args.sampler]
    start = time.perf_counter()
    tokens = jax.block_until_ready(run())
    seconds = time.perf_counter() - start
    print(f"{args.sampler}: {num_samples * args.streams} samples in {seconds:.2f} s "
          f"(including compilation), {num_samples * args.streams / seconds:.0f} samples/s")
    out = Path(args.out or Path(args.workdir) / "samples")
    for stream, codes in enumerate(tokens):
        waveform = audio.mu_law_decode(codes, config.model.quantization_levels)
        wav = audio.write_wav(out / f"{args.sampler}-{stream}.wav", waveform, config.sample_rate)
        audio.plot_spectrogram(wav.with_suffix(".png"), waveform, config.sample_rate,
                               f"WaveNet sample ({args.sampler}, stream {stream})")
        print(f"wrote {wav} and {wav.with_suffix('.png')}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=COMMANDS)
    parser.add_argument("--config", default=None, choices=CONFIG_NAMES,
                        help="a module of models/wavenet/configs; by default the run's in "
                             "WORKDIR/config.json, else small")
    parser.add_argument("--workdir", default="workdir/wavenet")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="FIELD=VALUE",
                        help="override top-level config fields, e.g. num_epochs=3")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--sampler", choices=SAMPLERS, default="fused")
    parser.add_argument("--stages", type=int, default=2,
                        help="devices the layer-sharded samplers place the layers on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder for WAV + PNG (default: WORKDIR/samples)")
    args = parser.parse_args(argv)
    # `--set a=1 train` hands the command to --set.
    if args.command is None and args.set and args.set[-1] in COMMANDS:
        args.command = args.set.pop()
    if args.command is None:
        parser.error("the command (train or sample) is required")
    if not 0 < args.seconds < math.inf or args.streams < 1 or args.stages < 1:
        parser.error("--seconds must be positive and finite, --streams and --stages at least 1")

    from models.wavenet import configs, train

    # A work directory keeps its run's configuration (WORKDIR/config.json): training without
    # --config resumes it, and sampling uses it (a --config of another model is refused).
    stored = train.stored_config(args.workdir)
    config = (configs.get_config(args.config) if args.config
              else stored or configs.get_config("small"))
    if args.command == "sample" and stored is not None:
        if config.model != stored.model:
            raise SystemExit(f"--config {args.config}: the run in {args.workdir} trained another "
                             f"model ({stored.model}); leave --config out to sample from it")
        config = stored
    try:
        config = apply_overrides(config, args.set)
    except ValueError as error:  # the config's own checks
        raise SystemExit(f"--set {' '.join(args.set)}: {error}") from error
    if (args.command == "sample" and stored is not None
            and (config.model, config.sample_rate) != (stored.model, stored.sample_rate)):
        # The samples would come from the stored weights, at another rate than they were
        # trained at, or shaped for another model (the WAV played at twice the speed).
        raise SystemExit(f"--set {' '.join(args.set)}: sampling uses the model and sample rate "
                         f"the run in {args.workdir} trained ({stored.model}, "
                         f"{stored.sample_rate} Hz)")
    if args.command == "train":
        train.train_and_evaluate(config, args.workdir)
    else:
        sample_command(config, args)


if __name__ == "__main__":
    main()
