"""Command line for Deep Speech 2.

    python -m models.deepspeech.main train --config tiny --workdir workdir/deepspeech-tiny
    python -m models.deepspeech.main transcribe --workdir workdir/deepspeech-tiny speech.wav
    python -m models.deepspeech.main say "turn on the light" speech.wav   # a test WAV via espeak-ng

`--set key=value` overrides any config field (see configs.py), e.g. ``--set num_devices=2``.

Under ``mpiexec -n N`` (N > 1) training runs data-parallel over the N processes, one JAX device
each (``num_devices`` is ignored); see models/deepspeech/train.py.

    mpiexec -n 2 python -m models.deepspeech.train --config tiny --workdir workdir/deepspeech-tiny
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# Under the git-ignored workdir/ of the repository.
DEFAULT_CACHE = Path(__file__).resolve().parents[2] / "workdir" / "cache"


def _parse_overrides(pairs):
    overrides = {}
    for pair in pairs or []:
        key, _, value = pair.partition("=")
        overrides[key] = value
    return overrides


def _use_cpu_devices(count: int):
    """N host devices for in-process data parallelism; must run before jax starts its backend."""
    if count > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        import jax

        jax.config.update("jax_num_cpu_devices", count)


def train(args):
    from models.deepspeech import configs
    from models.deepspeech import train as training  # starts no JAX backend yet

    config = configs.get_config(args.config, **_parse_overrides(args.set))
    if training.launched_processes() == 1:
        _use_cpu_devices(config.num_devices)
        history = training.train_and_evaluate(config, args.workdir, cache_dir=args.cache_dir)
        print(json.dumps(history[-1] if history else {}, indent=1))
        return
    # Under mpiexec -n N: one device per process. An error on one rank aborts the job (as
    # `python -m mpi4py` does) instead of leaving the others waiting for it.
    from mpi4py import MPI

    try:
        history = training.train_and_evaluate(config, args.workdir, cache_dir=args.cache_dir)
    except BaseException:
        import sys
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        raise SystemExit(1)  # Abort may return before the launcher ends this process
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps(history[-1] if history else {}, indent=1))


def transcribe(args):
    import numpy as np

    from models.deepspeech import configs, data, decoding
    from models.deepspeech import train as training

    workdir = Path(args.workdir)
    if not (workdir / "config.json").exists():
        raise SystemExit(f"no training run in {workdir} (it has no config.json)")
    try:
        config = configs.Config().replace(**{
            k: json.dumps(v) if isinstance(v, list) else str(v)
            for k, v in json.loads((workdir / "config.json").read_text()).items()})
    except ValueError as error:
        raise SystemExit(f"{workdir / 'config.json'} describes no model this version builds: "
                         f"{error}") from error
    features = data.log_spectrogram(read_wav(args.wav, config.sample_rate), config.sample_rate)
    model = training.create_model(config, seed=0)
    graphdef, params, batch_stats = nnx_split(model)
    template = {"params": params, "batch_stats": batch_stats}
    with training.checkpoint_manager(workdir, read_only=True) as manager:
        restored = training.restore_checkpoint(manager, _with_opt_state(config, template))
    if restored is None:
        raise SystemExit(f"no checkpoint in {workdir / 'checkpoints'}")
    state = restored[1]
    log_probs, mask = training.predict_log_probs(
        graphdef, state["params"], state["batch_stats"], features[None], np.ones((1, len(features)),
                                                                            np.float32))
    print("greedy:", decoding.greedy_decode(log_probs, mask)[0])
    print("beam:  ", decoding.beam_decode(log_probs, mask, config.beam_width)[0])


def read_wav(path, sample_rate: int):
    """`path`'s samples as float32 at `sample_rate`, channels averaged, peak at 1."""
    import numpy as np
    import scipy.io.wavfile
    import scipy.signal

    rate, audio = scipy.io.wavfile.read(path)
    # 8-bit PCM is unsigned, centred on 128: every other format is centred on 0.
    audio = audio.astype(np.float32) - (128 if audio.dtype == np.uint8 else 0)
    if audio.ndim == 2:
        audio = audio.mean(axis=1)
    if audio.size == 0:
        raise SystemExit(f"{path} holds no samples")
    audio /= max(np.abs(audio).max(), 1e-9)
    ratio = np.gcd(rate, sample_rate)
    return scipy.signal.resample_poly(audio, sample_rate // ratio, rate // ratio)


def nnx_split(model):
    from flax import nnx

    return nnx.split(model, nnx.Param, nnx.BatchStat)


def _with_opt_state(config, template):
    """The checkpoint also holds the optimizer state; restoring needs its structure."""
    from models.deepspeech import train as training

    optimizer = training.create_optimizer(config, steps_per_epoch=1)
    return template | {"opt_state": optimizer.init(template["params"])}


def say(args):
    import numpy as np
    import scipy.io.wavfile

    from models import espeak
    from models.deepspeech import data

    utterance = data.Utterance(args.text, args.voice, args.rate, 50, 50, snr_db=60.0)
    rng = np.random.default_rng(0)
    speech = espeak.Espeak.get().speak(data.speech_request(utterance, rng), 16000)
    audio = data.render(utterance, speech, 16000, rng)
    scipy.io.wavfile.write(args.wav, 16000, (audio * 32767 / max(np.abs(audio).max(), 1e-9))
                           .astype(np.int16))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="train and evaluate every epoch")
    train_parser.add_argument("--config", default="tiny")
    train_parser.add_argument("--workdir", required=True)
    train_parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    train_parser.add_argument("--set", action="append", metavar="KEY=VALUE")
    train_parser.set_defaults(run=train)
    transcribe_parser = commands.add_parser("transcribe", help="transcribe a WAV file")
    transcribe_parser.add_argument("--workdir", required=True)
    transcribe_parser.add_argument("wav")
    transcribe_parser.set_defaults(run=transcribe)
    say_parser = commands.add_parser("say", help="synthesise a WAV file with espeak-ng")
    say_parser.add_argument("text")
    say_parser.add_argument("wav")
    say_parser.add_argument("--voice", default="en-us+m7")
    say_parser.add_argument("--rate", type=int, default=160)
    say_parser.set_defaults(run=say)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
