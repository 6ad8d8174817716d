// 2-D convolutions on oneDNN, as XLA:CPU FFI calls (learner/backends/cpu/onednn_conv.py).
//
// SeedrlOnednnConv: a convolution with bias and optional ReLU, for the policy on a CPU:
// jaxlib 0.10.2 runs convolutions on Eigen's kernels, which trail oneDNN's on the Nature
// CNN at the batches inference serves (docs/benchmarks.md, case e).
// SeedrlOnednnConvKernelGrad: a convolution's kernel and bias gradients, for the train
// step on a CPU: XLA:CPU computes a kernel gradient as a convolution of the input and
// the output gradient with their batch and feature dimensions swapped, and the two
// transposes that takes cost several times the convolution itself.
//
// The batch is cut into one slice per thread of XLA's intra-op pool, and each slice
// runs a single-threaded oneDNN primitive; so a call uses XLA's own threads and
// oneDNN's OpenMP team never starts. A kernel gradient sums its slices' partial ones.
//
// Layouts: input NHWC, kernel HWIO, output NHWC, all float32, row-major.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

extern "C" void omp_set_num_threads(int);  // libgomp, which libdnnl links

namespace ffi = xla::ffi;
using dnnl::memory;

namespace {

struct Geometry {
  memory::dim rows, height, width, channels, kernel_h, kernel_w, features, out_h, out_w;
  memory::dim stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right;
  bool relu;

  std::string Key() const {
    std::string key;
    for (memory::dim v : {rows, height, width, channels, kernel_h, kernel_w, features, out_h,
                          out_w, stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right,
                          static_cast<memory::dim>(relu)}) {
      key += std::to_string(v);
      key += ',';
    }
    return key;
  }
};

// The first 64-byte boundary in `buffer`, grown to hold `bytes` from there: oneDNN's
// kernels read and write whole cache lines.
void* Aligned(std::vector<char>& buffer, size_t bytes) {
  constexpr size_t kAlign = 64;
  buffer.resize(bytes + kAlign);
  auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + (kAlign - address % kAlign) % kAlign;
}

// One compiled primitive for one geometry, and the reorder of HWIO kernels into
// the layout it chose.
struct Primitive {
  dnnl::convolution_forward convolution;
  dnnl::reorder kernel_reorder;
  memory::desc input, output, bias, user_kernel, kernel, scratchpad, reorder_scratchpad;
};

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// oneDNN sizes a primitive's work for the threads of the thread that creates and
// runs it; every thread that touches oneDNN here asks for one.
void SingleThreaded() {
  thread_local bool done = false;
  if (!done) {
    omp_set_num_threads(1);
    done = true;
  }
}

// A geometry's memory descriptors, strides and paddings, as oneDNN takes them.
struct Descriptors {
  explicit Descriptors(const Geometry& g)
      // oneDNN names dimensions in NCHW order whatever the layout in memory.
      : input({g.rows, g.channels, g.height, g.width}, f32, memory::format_tag::nhwc),
        output({g.rows, g.features, g.out_h, g.out_w}, f32, memory::format_tag::nhwc),
        bias({g.features}, f32, memory::format_tag::a),
        user_kernel({g.features, g.channels, g.kernel_h, g.kernel_w}, f32,
                    memory::format_tag::hwio),
        any_kernel({g.features, g.channels, g.kernel_h, g.kernel_w}, f32,
                   memory::format_tag::any),
        strides({g.stride_h, g.stride_w}),
        pad_l({g.pad_top, g.pad_left}),
        pad_r({g.pad_bottom, g.pad_right}) {}

  static constexpr memory::data_type f32 = memory::data_type::f32;
  memory::desc input, output, bias, user_kernel, any_kernel;
  memory::dims strides, pad_l, pad_r;
};

// The cached value of `make(g)` for geometry g, made on first use; a map per type T.
template <typename T, typename Make>
const T& Cached(const Geometry& g, Make make) {
  static std::mutex mutex;
  static std::unordered_map<std::string, std::unique_ptr<T>> cache;
  const std::string key = g.Key();
  std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find(key);
  if (found == cache.end()) found = cache.emplace(key, std::make_unique<T>(make(g))).first;
  return *found->second;
}

Primitive MakePrimitive(const Geometry& g) {
  const Descriptors d(g);
  dnnl::primitive_attr attr;
  // The caller passes each slice its own scratchpad: slices run at once.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (g.relu) {
    dnnl::post_ops ops;
    ops.append_eltwise(dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
    attr.set_post_ops(ops);
  }
  dnnl::convolution_forward::primitive_desc desc(
      Engine(), dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct, d.input,
      d.any_kernel, d.bias, d.output, d.strides, d.pad_l, d.pad_r, attr);
  // The reorder too may run on two threads at once (two calls of the policy).
  dnnl::primitive_attr reorder_attr;
  reorder_attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::reorder::primitive_desc reorder(Engine(), d.user_kernel, Engine(), desc.weights_desc(),
                                        reorder_attr);
  return Primitive{dnnl::convolution_forward(desc), dnnl::reorder(reorder), d.input, d.output,
                   d.bias, d.user_kernel, desc.weights_desc(), desc.scratchpad_desc(),
                   reorder.scratchpad_desc()};
}

const Primitive& Compiled(const Geometry& g) { return Cached<Primitive>(g, MakePrimitive); }

// Slices handed out to whichever thread asks next: the calling thread takes
// slices too, so the call finishes even if no pool thread is free to help.
struct Slices {
  explicit Slices(int count, std::function<void(int)> run) : count(count), run(std::move(run)) {}

  void Work() {
    for (int i; (i = next.fetch_add(1)) < count;) {
      try {
        run(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
      }
      if (finished.fetch_add(1) + 1 == count) {
        std::lock_guard<std::mutex> lock(mutex);
        done.notify_all();
      }
    }
  }

  void Wait() {
    std::unique_lock<std::mutex> lock(mutex);
    done.wait(lock, [this] { return finished.load() == count; });
  }

  const int count;
  const std::function<void(int)> run;
  std::atomic<int> next{0};
  std::atomic<int> finished{0};
  std::mutex mutex;
  std::condition_variable done;
  std::exception_ptr error;
};

// A batch cut into one slice per thread of XLA's pool (fewer when there are fewer rows):
// slice i has `base` rows, one more for the first `extra`, so at most two geometries.
struct Cut {
  Cut(memory::dim rows, int64_t threads)
      : count(static_cast<int>(std::min<int64_t>(std::max<int64_t>(1, threads), rows))),
        base(rows / count),
        extra(rows % count) {}

  memory::dim Start(int i) const { return i * base + std::min<memory::dim>(i, extra); }

  Geometry Slice(const Geometry& whole, int i) const {
    Geometry g = whole;
    g.rows = base + (i < extra ? 1 : 0);
    return g;
  }

  const int count;
  const memory::dim base, extra;
};

// Runs slices 0..count-1 of `run` on the calling thread and `pool`'s, returning once all
// are done and rethrowing the first error.
void RunSlices(ffi::ThreadPool& pool, int count, const std::function<void(int)>& run) {
  if (count == 1) {
    run(0);
    return;
  }
  // Shared with the pool's tasks, which may start after this call has returned
  // (when this thread took every slice); they then find nothing to do.
  auto slices = std::make_shared<Slices>(count, run);
  try {
    for (int i = 1; i < count; ++i) pool.Schedule([slices] { slices->Work(); });
  } catch (...) {
    // Tasks already queued read this frame: finish every slice before leaving.
    slices->Work();
    slices->Wait();
    throw;
  }
  slices->Work();
  slices->Wait();
  if (slices->error) std::rethrow_exception(slices->error);
}

ffi::Error Convolve(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> kernel,
                    ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> y, int64_t stride_h,
                    int64_t stride_w, int64_t pad_top, int64_t pad_bottom, int64_t pad_left,
                    int64_t pad_right, bool relu) {
  const auto xd = x.dimensions(), kd = kernel.dimensions(), yd = y->dimensions();
  if (xd.size() != 4 || kd.size() != 4 || yd.size() != 4 || bias.dimensions().size() != 1 ||
      kd[2] != xd[3] || kd[3] != yd[3] || bias.dimensions()[0] != kd[3] || yd[0] != xd[0]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "seedrl_onednn_conv: expects NHWC input, HWIO kernel, [O] bias, NHWC output");
  }
  const Geometry whole{xd[0],    xd[1],      xd[2],   xd[3],      kd[0],     kd[1],
                       kd[3],    yd[1],      yd[2],   stride_h,   stride_w,  pad_top,
                       pad_bottom, pad_left, pad_right, relu};
  if (whole.rows == 0) return ffi::Error::Success();
  try {
    // The calling thread is XLA's; it keeps OpenMP single-threaded from here on.
    SingleThreaded();
    const Cut cut(whole.rows, pool.num_threads());
    const int count = cut.count;
    std::vector<const Primitive*> primitives(count);
    for (int i = 0; i < count; ++i) primitives[i] = &Compiled(cut.Slice(whole, i));
    // The kernel in the layout each primitive chose, reordered once per call per layout.
    thread_local dnnl::stream stream(Engine());
    thread_local std::vector<std::vector<char>> kernel_copies;
    std::vector<memory::desc> layouts;
    std::vector<void*> copies;
    std::vector<memory> kernels(count);
    memory user_kernel(primitives[0]->user_kernel, Engine(), kernel.typed_data());
    for (int i = 0; i < count; ++i) {
      size_t slot = 0;
      while (slot < layouts.size() && !(layouts[slot] == primitives[i]->kernel)) ++slot;
      if (slot == layouts.size()) {
        layouts.push_back(primitives[i]->kernel);
        if (kernel_copies.size() <= slot) kernel_copies.resize(slot + 1);
        copies.push_back(Aligned(kernel_copies[slot], primitives[i]->kernel.get_size()));
        memory copy(primitives[i]->kernel, Engine(), copies[slot]);
        thread_local std::vector<char> reorder_scratchpad;
        const memory::desc& pad_desc = primitives[i]->reorder_scratchpad;
        memory pad(pad_desc, Engine(), Aligned(reorder_scratchpad, pad_desc.get_size()));
        primitives[i]->kernel_reorder.execute(
            stream, {{DNNL_ARG_FROM, user_kernel}, {DNNL_ARG_TO, copy}, {DNNL_ARG_SCRATCHPAD, pad}});
      }
      kernels[i] = memory(primitives[i]->kernel, Engine(), copies[slot]);
    }
    stream.wait();

    const float* in = x.typed_data();
    float* out = y->typed_data();
    const int64_t in_row = whole.height * whole.width * whole.channels;
    const int64_t out_row = whole.out_h * whole.out_w * whole.features;
    auto run = [&, in, out](int i) {
      SingleThreaded();
      thread_local dnnl::stream slice_stream(Engine());
      thread_local std::vector<char> scratchpad;
      const Primitive& p = *primitives[i];
      const int64_t start = cut.Start(i);
      memory src(p.input, Engine(), const_cast<float*>(in + start * in_row));
      memory dst(p.output, Engine(), out + start * out_row);
      memory b(p.bias, Engine(), bias.typed_data());
      memory pad(p.scratchpad, Engine(), Aligned(scratchpad, p.scratchpad.get_size()));
      p.convolution.execute(slice_stream, {{DNNL_ARG_SRC, src},
                                           {DNNL_ARG_WEIGHTS, kernels[i]},
                                           {DNNL_ARG_BIAS, b},
                                           {DNNL_ARG_DST, dst},
                                           {DNNL_ARG_SCRATCHPAD, pad}});
      slice_stream.wait();
    };
    RunSlices(pool, count, run);
  } catch (const dnnl::error& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("seedrl_onednn_conv: ") + e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("seedrl_onednn_conv: ") + e.what());
  }
  return ffi::Error::Success();
}

// One compiled kernel-gradient primitive for one geometry, and the reorder of the
// kernel gradient from the layout it chose into HWIO.
struct GradientPrimitive {
  dnnl::convolution_backward_weights gradient;
  dnnl::reorder to_user;
  memory::desc input, output, bias, kernel, user_kernel, scratchpad, reorder_scratchpad;
};

GradientPrimitive MakeGradientPrimitive(const Geometry& g) {
  const Descriptors d(g);
  // A backward primitive takes the forward one's description as its hint.
  dnnl::convolution_forward::primitive_desc forward(
      Engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, d.input,
      d.any_kernel, d.bias, d.output, d.strides, d.pad_l, d.pad_r);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::convolution_backward_weights::primitive_desc desc(
      Engine(), dnnl::algorithm::convolution_direct, d.input, d.any_kernel, d.bias, d.output,
      d.strides, d.pad_l, d.pad_r, forward, attr);
  dnnl::primitive_attr reorder_attr;
  reorder_attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::reorder::primitive_desc reorder(Engine(), desc.diff_weights_desc(), Engine(),
                                        d.user_kernel, reorder_attr);
  return GradientPrimitive{dnnl::convolution_backward_weights(desc),
                           dnnl::reorder(reorder),
                           d.input,
                           d.output,
                           d.bias,
                           desc.diff_weights_desc(),
                           d.user_kernel,
                           desc.scratchpad_desc(),
                           reorder.scratchpad_desc()};
}

const GradientPrimitive& CompiledGradient(const Geometry& g) {
  return Cached<GradientPrimitive>(g, MakeGradientPrimitive);
}

ffi::Error KernelGradient(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::F32> output_grad, ffi::ResultBuffer<ffi::F32> kernel_grad,
                          ffi::ResultBuffer<ffi::F32> bias_grad, int64_t stride_h,
                          int64_t stride_w, int64_t pad_top, int64_t pad_bottom, int64_t pad_left,
                          int64_t pad_right) {
  const auto xd = x.dimensions(), yd = output_grad.dimensions(), kd = kernel_grad->dimensions();
  if (xd.size() != 4 || yd.size() != 4 || kd.size() != 4 ||
      bias_grad->dimensions().size() != 1 || kd[2] != xd[3] || kd[3] != yd[3] ||
      bias_grad->dimensions()[0] != kd[3] || yd[0] != xd[0]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "seedrl_onednn_conv_kernel_grad: expects NHWC input and output "
                      "gradient, HWIO kernel gradient, [O] bias gradient");
  }
  const Geometry whole{xd[0],    xd[1],      xd[2],   xd[3],      kd[0],     kd[1],
                       kd[3],    yd[1],      yd[2],   stride_h,   stride_w,  pad_top,
                       pad_bottom, pad_left, pad_right, false};
  const int64_t kernel_size = kd[0] * kd[1] * kd[2] * kd[3];
  float* kernel_out = kernel_grad->typed_data();
  float* bias_out = bias_grad->typed_data();
  std::fill(kernel_out, kernel_out + kernel_size, 0.0f);
  std::fill(bias_out, bias_out + whole.features, 0.0f);
  if (whole.rows == 0) return ffi::Error::Success();
  try {
    SingleThreaded();
    const Cut cut(whole.rows, pool.num_threads());
    const int count = cut.count;
    std::vector<const GradientPrimitive*> primitives(count);
    for (int i = 0; i < count; ++i) primitives[i] = &CompiledGradient(cut.Slice(whole, i));
    // Each slice's partial gradients, in HWIO; summed below.
    std::vector<std::vector<float>> kernels(count, std::vector<float>(kernel_size));
    std::vector<std::vector<float>> biases(count, std::vector<float>(whole.features));
    const float* in = x.typed_data();
    const float* grad = output_grad.typed_data();
    const int64_t in_row = whole.height * whole.width * whole.channels;
    const int64_t out_row = whole.out_h * whole.out_w * whole.features;
    auto run = [&](int i) {
      SingleThreaded();
      thread_local dnnl::stream slice_stream(Engine());
      thread_local std::vector<char> scratchpad, reorder_scratchpad, blocked;
      const GradientPrimitive& p = *primitives[i];
      const int64_t start = cut.Start(i);
      memory src(p.input, Engine(), const_cast<float*>(in + start * in_row));
      memory diff_dst(p.output, Engine(), const_cast<float*>(grad + start * out_row));
      memory diff_kernel(p.kernel, Engine(), Aligned(blocked, p.kernel.get_size()));
      memory diff_bias(p.bias, Engine(), biases[i].data());
      memory pad(p.scratchpad, Engine(), Aligned(scratchpad, p.scratchpad.get_size()));
      p.gradient.execute(slice_stream, {{DNNL_ARG_SRC, src},
                                        {DNNL_ARG_DIFF_DST, diff_dst},
                                        {DNNL_ARG_DIFF_WEIGHTS, diff_kernel},
                                        {DNNL_ARG_DIFF_BIAS, diff_bias},
                                        {DNNL_ARG_SCRATCHPAD, pad}});
      memory user(p.user_kernel, Engine(), kernels[i].data());
      memory reorder_pad(p.reorder_scratchpad, Engine(),
                         Aligned(reorder_scratchpad, p.reorder_scratchpad.get_size()));
      p.to_user.execute(slice_stream, {{DNNL_ARG_FROM, diff_kernel},
                                       {DNNL_ARG_TO, user},
                                       {DNNL_ARG_SCRATCHPAD, reorder_pad}});
      slice_stream.wait();
    };
    RunSlices(pool, count, run);
    for (int i = 0; i < count; ++i) {
      for (int64_t j = 0; j < kernel_size; ++j) kernel_out[j] += kernels[i][j];
      for (int64_t j = 0; j < whole.features; ++j) bias_out[j] += biases[i][j];
    }
  } catch (const dnnl::error& e) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("seedrl_onednn_conv_kernel_grad: ") + e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("seedrl_onednn_conv_kernel_grad: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

// The attributes both handlers take after their buffers: the strides and the pads.
template <typename Binding>
auto WithGeometry(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("stride_h")
      .template Attr<int64_t>("stride_w")
      .template Attr<int64_t>("pad_top")
      .template Attr<int64_t>("pad_bottom")
      .template Attr<int64_t>("pad_left")
      .template Attr<int64_t>("pad_right");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SeedrlOnednnConv, Convolve,
                              WithGeometry(ffi::Ffi::Bind()
                                               .Ctx<ffi::ThreadPool>()
                                               .Arg<ffi::Buffer<ffi::F32>>()
                                               .Arg<ffi::Buffer<ffi::F32>>()
                                               .Arg<ffi::Buffer<ffi::F32>>()
                                               .Ret<ffi::Buffer<ffi::F32>>())
                                  .Attr<bool>("relu"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SeedrlOnednnConvKernelGrad, KernelGradient,
                              WithGeometry(ffi::Ffi::Bind()
                                               .Ctx<ffi::ThreadPool>()
                                               .Arg<ffi::Buffer<ffi::F32>>()
                                               .Arg<ffi::Buffer<ffi::F32>>()
                                               .Ret<ffi::Buffer<ffi::F32>>()
                                               .Ret<ffi::Buffer<ffi::F32>>()));
