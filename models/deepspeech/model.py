"""Deep Speech 2 (Amodei et al. 2015, arXiv 1512.02595) in Flax NNX.

log spectrogram -> 2D convolutions, strided in time -> stacked bidirectional GRUs (directions
summed, sequence-wise batch norm on the input projection) -> dense -> per-frame character logits,
trained with CTC.

Every layer takes a frame mask, so padded frames neither change batch-norm statistics nor leak into
the backward recurrence. Pass `axis_name` during data-parallel training, and batch-norm statistics
are summed across replicas with jaxring (so N replicas normalise like one device on the global
batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxring.parallel import data as data_parallel

CLIP = 20.0  # the paper's clipped ReLU: min(max(x, 0), 20)


def clipped_relu(x):
    return jnp.clip(x, 0.0, CLIP)


class SequenceBatchNorm(nnx.Module):
    """Batch norm whose statistics run over batch and time (and any other leading axes) of the
    real frames only: the paper's sequence-wise normalisation (section 3.2)."""

    def __init__(self, features: int, *, momentum: float = 0.99, epsilon: float = 1e-5):
        self.momentum, self.epsilon = momentum, epsilon
        self.scale = nnx.Param(jnp.ones((features,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((features,), jnp.float32))
        self.mean = nnx.BatchStat(jnp.zeros((features,), jnp.float32))
        self.var = nnx.BatchStat(jnp.ones((features,), jnp.float32))

    def __call__(self, x, mask, *, train: bool, axis_name=None):
        """x: (batch, time, ..., features); mask: (batch, time)."""
        mask = mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))
        if train:
            mean, var = data_parallel.masked_moments(x, mask, axis_name)
            momentum = self.momentum
            self.mean[...] = momentum * self.mean[...] + (1 - momentum) * mean
            self.var[...] = momentum * self.var[...] + (1 - momentum) * var
        else:
            mean, var = self.mean[...], self.var[...]
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon) * self.scale[...] + self.bias[...]
        return y * mask


class BidirectionalGRU(nnx.Module):
    """One layer of forward and backward GRUs whose outputs are summed (paper, section 3.1).

    The input projection W x for all gates of both directions is one matmul, batch-normalised
    over the sequence; the recurrent part runs both directions in a single scan.
    """

    def __init__(self, in_features: int, hidden: int, *, rngs: nnx.Rngs):
        self.hidden = hidden
        self.input_projection = nnx.Linear(in_features, 2 * 3 * hidden, use_bias=False,
                                           rngs=rngs, param_dtype=jnp.float32)
        self.norm = SequenceBatchNorm(2 * 3 * hidden)
        init = nnx.initializers.orthogonal()
        keys = jax.random.split(rngs.params(), 2)
        self.recurrent = nnx.Param(jnp.stack(
            [jnp.concatenate([init(k, (hidden, hidden), jnp.float32)
                              for k in jax.random.split(key, 3)], axis=1) for key in keys]))
        self.recurrent_bias = nnx.Param(jnp.zeros((2, 3 * hidden), jnp.float32))

    def __call__(self, x, mask, *, train: bool, axis_name=None):
        batch, time, _ = x.shape
        projected = self.norm(self.input_projection(x), mask, train=train, axis_name=axis_name)
        projected = projected.reshape(batch, time, 2, 3 * self.hidden)
        # Time-major, the backward direction reversed in time: step t sees frame t forwards and
        # frame T-1-t backwards. Padding sits at the end, so the backward pass meets it first;
        # the mask holds its state at zero there, and it starts fresh at the last real frame.
        forward, backward = projected[:, :, 0], projected[:, ::-1, 1]
        inputs = jnp.stack([forward, backward], axis=1).transpose(2, 1, 0, 3)  # (T, 2, B, 3H)
        masks = jnp.stack([mask, mask[:, ::-1]], axis=0).transpose(2, 0, 1)[..., None]
        recurrent, bias = self.recurrent[...], self.recurrent_bias[...][:, None, :]

        def step(state, inputs_t):
            x_t, mask_t = inputs_t  # (2, B, 3H), (2, B, 1)
            h = jnp.einsum("dbh,dhk->dbk", state, recurrent) + bias
            x_z, x_r, x_n = jnp.split(x_t, 3, axis=-1)
            h_z, h_r, h_n = jnp.split(h, 3, axis=-1)
            update = jax.nn.sigmoid(x_z + h_z)
            reset = jax.nn.sigmoid(x_r + h_r)
            candidate = jnp.tanh(x_n + reset * h_n)
            new_state = (1 - update) * state + update * candidate
            new_state = mask_t * new_state + (1 - mask_t) * state
            return new_state, new_state

        # Zeros derived from the inputs, so that under shard_map's type checker the carry varies
        # over the data axis exactly as the inputs do.
        initial = jnp.zeros_like(inputs[0, ..., :self.hidden])  # (2, B, H)
        _, outputs = jax.lax.scan(step, initial, (inputs, masks))  # (T, 2, B, H)
        outputs = outputs.transpose(1, 2, 0, 3)  # (2, B, T, H)
        return (outputs[0] + outputs[1][:, ::-1]) * mask[..., None]


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """XLA's "SAME" padding of an axis of `size`: ceil(size / stride) outputs, the padding split
    in half, the smaller half before."""
    total = max((-(-size // stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def conv_padding(frequency: int, kernel, stride):
    """(time, frequency) padding of a convolution: ceil(n / stride) outputs along each axis.

    Time: "SAME" pads by what the padded length needs, so with a stride the real frames would
    be aligned one way in an even and another in an odd length, and would depend on how much
    padding follows them (an unpadded odd-length utterance at transcription would meet an
    alignment never trained on). So the padding before is fixed: "SAME"'s on a length that the
    stride divides, which every training batch has (time is padded to `frame_multiple`), and
    k - 1 - that after, which gives ceil(T / stride) outputs for every T, output i seeing input
    i * stride and the frames around it whatever the padding. Frequency has one size, so
    "SAME"."""
    (time_kernel, frequency_kernel), (time_stride, frequency_stride) = kernel, stride
    before = max(time_kernel - time_stride, 0) // 2
    return ((before, time_kernel - 1 - before),
            same_padding(frequency, frequency_kernel, frequency_stride))


class DeepSpeech2(nnx.Module):
    """Log spectrogram (batch, frames, frequency bins) -> logits (batch, frames / stride,
    classes), with the output frame mask."""

    def __init__(self, *, feature_size: int, num_classes: int, conv_channels, conv_kernels,
                 conv_strides, rnn_layers: int, rnn_hidden: int, dense: int, rngs: nnx.Rngs):
        self.convs, self.conv_norms = nnx.List(), nnx.List()
        self.time_strides = tuple(stride[0] for stride in conv_strides)
        frequency, channels = feature_size, 1
        for out_channels, kernel, stride in zip(conv_channels, conv_kernels, conv_strides):
            self.convs.append(nnx.Conv(channels, out_channels, tuple(kernel), strides=tuple(stride),
                                       padding=conv_padding(frequency, kernel, stride),
                                       use_bias=False, rngs=rngs, param_dtype=jnp.float32))
            self.conv_norms.append(SequenceBatchNorm(out_channels))
            frequency, channels = -(-frequency // stride[1]), out_channels
        in_features = frequency * channels
        self.rnns = nnx.List()
        for _ in range(rnn_layers):
            self.rnns.append(BidirectionalGRU(in_features, rnn_hidden, rngs=rngs))
            in_features = rnn_hidden
        self.dense = nnx.Linear(in_features, dense, rngs=rngs, param_dtype=jnp.float32)
        self.output = nnx.Linear(dense, num_classes, rngs=rngs, param_dtype=jnp.float32)

    def output_mask(self, mask):
        for stride in self.time_strides:
            mask = mask[:, ::stride]  # ceil(T / stride) outputs, i real if input i * stride is
        return mask

    def __call__(self, features, mask, *, train: bool = False, axis_name=None):
        x = (features * mask[..., None])[..., None]  # (B, T, F, 1)
        for conv, norm, stride in zip(self.convs, self.conv_norms, self.time_strides):
            x = conv(x)
            mask = mask[:, ::stride]
            x = clipped_relu(norm(x, mask, train=train, axis_name=axis_name))
        batch, time = x.shape[:2]
        x = x.reshape(batch, time, -1)
        for rnn in self.rnns:
            x = rnn(x, mask, train=train, axis_name=axis_name)
        x = clipped_relu(self.dense(x))
        return self.output(x), mask


def ctc_loss_per_utterance(logits, logit_mask, labels, label_mask):
    """CTC negative log likelihood of each utterance (optax.ctc_loss, blank = class 0)."""
    return optax.ctc_loss(logits, 1.0 - logit_mask, labels, 1.0 - label_mask)
