// The XLA FFI handler body of the GPU WaveNet sampler (the target jaxring_wavenet_sample, which
// models/wavenet_cpu.cc serves on CPU), for two devices: CUDA (cuda/wavenet_handler.cc) and the
// host emulation that tests the kernel without a GPU (models/wavenet_gpu_emulated.cc). It checks
// the operands against the sizes as the CPU handler does, then runs the kernel of
// cuda/wavenet_sampler.h. `Device` reads the starting tokens to the host, copies the queues when
// XLA did not alias them, and launches; each returns "" or what failed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/wavenet_sampler.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring::models {

template <typename Device>
xla::ffi::Error RunSampleHandler(
    Device& device, xla::ffi::AnyBuffer weights, xla::ffi::Buffer<xla::ffi::F32> gate_bias,
    xla::ffi::Buffer<xla::ffi::F32> local, xla::ffi::Buffer<xla::ffi::F32> noise,
    xla::ffi::Buffer<xla::ffi::S32> token, xla::ffi::Buffer<xla::ffi::F32> queues,
    xla::ffi::Buffer<xla::ffi::S32> first_step, xla::ffi::ResultBuffer<xla::ffi::S32>& tokens,
    xla::ffi::ResultBuffer<xla::ffi::F32>& queues_out,
    xla::ffi::ResultBuffer<xla::ffi::F32>& logits, int64_t residual, int64_t skip, int64_t hidden,
    int64_t levels, int64_t local_channels, int64_t panel_width,
    xla::ffi::Span<const int64_t> dilations) {
  namespace ffi = xla::ffi;
  const auto fail = [&](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(Device::kName) + ": " + what);
  };
  const ffi::DataType type = weights.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::F16)
    return fail("weights must be float32 or float16");
  const auto noise_dims = noise.dimensions();
  const SampleShapes shapes{
      residual, skip, hidden, levels, local_channels, panel_width,
      dilations.begin(), static_cast<int64_t>(dilations.size()),
      static_cast<int64_t>(token.element_count()),
      static_cast<int64_t>(noise_dims.size()), noise_dims.size() > 0 ? noise_dims[0] : 0,
      noise_dims.size() > 1 ? noise_dims[1] : 0,
      static_cast<int64_t>(queues.element_count()), static_cast<int64_t>(gate_bias.element_count()),
      static_cast<int64_t>(local.element_count()), static_cast<int64_t>(weights.element_count())};
  WaveNetSizes sizes;
  int64_t steps = 0;
  if (std::string error = PlanSample(shapes, &sizes, &steps); !error.empty()) return fail(error);
  // The starting tokens index the embedding: check them on the host (a few bytes per chunk).
  std::vector<int32_t> start(sizes.batch);
  if (std::string error = device.ReadTokens(token.typed_data(), start); !error.empty())
    return ffi::Error::Internal(std::string(Device::kName) + ": " + error);
  if (std::string error = CheckTokens(start.data(), sizes.batch, levels); !error.empty())
    return fail(error);
  float* queue_data = queues_out->typed_data();
  if (queue_data != queues.typed_data()) {
    if (std::string error = device.Copy(queue_data, queues.typed_data(), queues.element_count());
        !error.empty())
      return ffi::Error::Internal(std::string(Device::kName) + ": " + error);
  }
  float* logits_out = logits->element_count() == 0 ? nullptr : logits->typed_data();
  const std::string error = device.Launch(
      weights.untyped_data(), type == ffi::DataType::F16, LayoutOf(sizes), sizes, steps,
      first_step.typed_data(), gate_bias.typed_data(), local.typed_data(), noise.typed_data(),
      token.typed_data(), queue_data, tokens->typed_data(), logits_out);
  return error.empty() ? ffi::Error::Success()
                       : ffi::Error::Internal(std::string(Device::kName) + ": " + error);
}

}  // namespace jaxring::models

// The binding both handlers share after their context: the CPU sampler's operands and attributes
// (`portable` and `threads` choose among the CPU kernels and are ignored here).
#define JAXRING_WAVENET_SAMPLE_OPERANDS(bind)               \
  (bind).Arg<xla::ffi::AnyBuffer>()                         \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()               \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()               \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()               \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()               \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()               \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()               \
      .Ret<xla::ffi::Buffer<xla::ffi::S32>>()               \
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>()               \
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>()               \
      .Attr<int64_t>("residual")                            \
      .Attr<int64_t>("skip")                                \
      .Attr<int64_t>("hidden")                              \
      .Attr<int64_t>("levels")                              \
      .Attr<int64_t>("local_channels")                      \
      .Attr<int64_t>("panel_width")                         \
      .Attr<xla::ffi::Span<const int64_t>>("dilations")     \
      .Attr<bool>("portable")                               \
      .Attr<int64_t>("threads")
