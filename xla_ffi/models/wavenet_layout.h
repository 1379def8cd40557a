// The packed weight layout and the call checks that the fused WaveNet sampler's handlers share:
// the CPU kernel (models/wavenet_cpu.cc) and the GPU kernel, on CUDA and in its host emulation
// (cuda/wavenet_handler.h). The layout is the one models/wavenet/fused_sampler.py's pack_weights
// writes (wavenet_cpu.cc's header comment describes it). Nothing here needs CUDA.
#pragma once

#include <cstdint>
#include <string>

namespace jaxring::models {

// Where each part of the packed weights starts, in elements.
struct WaveNetLayout {
  int64_t embedding, first_layer, layer_stride;
  int64_t gate, residual, skip, biases, local;  // offsets within a layer, in this order
  int64_t hidden, hidden_bias, logits, logits_bias, count;

  WaveNetLayout(int64_t r, int64_t skip_channels, int64_t hidden_units, int64_t levels,
                int64_t local_channels, int64_t layers) {
    embedding = 0;
    first_layer = levels * r;
    gate = 0;
    residual = 4 * r * r;
    skip = residual + r * r;
    biases = skip + r * skip_channels;
    local = biases + r + skip_channels;
    layer_stride = local + local_channels * 2 * r;
    hidden = first_layer + layers * layer_stride;
    hidden_bias = hidden + skip_channels * hidden_units;
    logits = hidden_bias + hidden_units;
    logits_bias = logits + hidden_units * levels;
    count = logits_bias + levels;
  }
};

// What a handler reads off XLA's buffers.
struct SampleShapes {
  int64_t residual, skip, hidden, levels, local_channels, panel_width;
  const int64_t* dilations;
  int64_t layers;
  int64_t batch;                  // starting tokens
  int64_t noise_rank, noise_rows, noise_cols;
  int64_t queues, gate_bias, local, weights;  // element counts
};

// What is wrong with the call, or "" if nothing.
inline std::string CheckSampleShapes(const SampleShapes& in) {
  if (in.panel_width <= 0 || in.panel_width % 8)
    return "panel_width must be a positive multiple of 8, got " + std::to_string(in.panel_width);
  int64_t queue_rows = 0;
  for (int64_t i = 0; i < in.layers; ++i) {
    if (in.dilations[i] < 1) return "dilations must be positive";
    queue_rows += in.dilations[i];
  }
  if (in.noise_rank != 2 || in.noise_cols != in.batch)
    return "the uniform numbers must be [steps, batch=" + std::to_string(in.batch) + "]";
  if (in.queues != queue_rows * in.batch * in.residual ||
      in.gate_bias != in.layers * in.batch * 2 * in.residual ||
      in.local != in.noise_rows * in.batch * in.local_channels)
    return "queues, gate bias or local conditioning do not match the sizes";
  const WaveNetLayout layout(in.residual, in.skip, in.hidden, in.levels, in.local_channels,
                             in.layers);
  if (layout.count != in.weights)
    return "the packed weights have " + std::to_string(in.weights) +
           " elements, the sizes given need " + std::to_string(layout.count);
  return "";
}

// Whether every starting token indexes the embedding; "" or what is wrong.
inline std::string CheckTokens(const int32_t* tokens, int64_t batch, int64_t levels) {
  for (int64_t b = 0; b < batch; ++b) {
    if (tokens[b] < 0 || tokens[b] >= levels)
      return "stream " + std::to_string(b) + " starts from token " + std::to_string(tokens[b]) +
             ", outside [0, " + std::to_string(levels) + ")";
  }
  return "";
}

}  // namespace jaxring::models
