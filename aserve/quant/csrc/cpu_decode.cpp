// A quantized decoder's decode step on CPU, every layer in one call (models/cpu_decode.py
// builds it and says when it runs).
//
// Between the kernels of a decode step, Python spent ~50 us a layer: module calls, the
// linear layers' wrappers and the boxing of each op's arguments, ~2 ms of the embedded
// model's 5.6 ms step. Here the layers' weights are held once, and each step walks them in
// C++, calling the very ops the modules call (`aserve_cpu::linear`, `gated_linear`,
// `moe_layer`, the norms, `norm_rope_store`, `decode_attention`) in the same order with the
// same inputs, so a step gives the same bits either way.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using Tensor = at::Tensor;
using MaybeTensor = std::optional<Tensor>;

// What `aserve_cpu::linear` takes of a weight (quant/native.py's `kernel_args`).
struct Weight {
  Tensor words, scales, offsets, bases;
  int64_t group, code_bits;
  MaybeTensor levels;
};

// One decoder layer: attention's weights and either a dense MLP (a fused gate|up weight and
// down) or a MoE layer (its router and its experts' gate|up and down stacks). `post_norm` is
// the norm before the MLP; Gemma's layers also normalise attention's output
// (`attention_out_norm`) and the MLP's (`mlp_out_norm`), gate with GELU, and read a window.
// gpt-oss's add each head's sink to attention's softmax, a bias to the output projection, the
// router and the experts (`expert_biases`: gate|up rows, down rows), and gate the experts by
// a clamped SwiGLU (`swiglu`: alpha, limit; a limit of 0 is SiLU-and-mul). Qwen2-MoE's add a
// shared expert to the routed ones, GLM-4.5's one without a gate, and route by sigmoid scores
// (`choice_bias`, `routed_scaling`, as moe_layer takes them).
struct Layer {
  Tensor input_norm, post_norm;
  std::vector<int64_t> qkv;  // weights whose outputs are joined into Q|K|V
  MaybeTensor qkv_bias, q_norm, k_norm;
  int64_t o;
  int64_t gate_up, down, inter;
  MaybeTensor router;
  int64_t top_k;
  bool renormalize;
  MaybeTensor attention_out_norm, mlp_out_norm;
  Tensor cos_sin;  // the layer's rotary table
  int64_t window;  // 0: the whole context
  bool gelu;
  MaybeTensor sinks, o_bias, router_bias, up_bias, down_bias;
  double swiglu_alpha, swiglu_limit;
  // Qwen2-MoE's shared expert beside the routed ones (a dense MLP, weighed by the sigmoid of
  // `shared_gate`'s one score; GLM-4.5's without it); the ids are -1 where there is none
  int64_t shared_gate_up, shared_down, shared_inter;
  MaybeTensor shared_gate;
  MaybeTensor choice_bias;
  double routed_scaling;
};

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using WeightArgs = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, int64_t, int64_t, const MaybeTensor&);

class DecodeStack : public torch::CustomClassHolder {
 public:
  // `softcap`: the scores' soft cap (Gemma 2), 0 for none; `residual_scale`: what each
  // attention and MLP output is multiplied by as it joins the residual stream (Granite's).
  // `post_norms` (OLMo 2, EXAONE 4): no norm before attention or the MLP, their outputs
  // normalised (`attention_out_norm`, `mlp_out_norm`) before they join the stream; its
  // layers' `input_norm` and `post_norm` are not read. `norms_across_heads` (OLMo 2): the
  // Q/K norms span all heads.
  DecodeStack(int64_t q_size, int64_t kv_size, int64_t head_dim, double eps, double scale,
              double softcap, double residual_scale, bool post_norms, bool norms_across_heads)
      : q_size_(q_size),
        kv_size_(kv_size),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale),
        softcap_(softcap),
        residual_scale_(residual_scale),
        post_norms_(post_norms),
        norms_across_heads_(norms_across_heads) {}

  // Keeps a weight; layers name it by the number returned.
  int64_t add_weight(Tensor words, Tensor scales, Tensor offsets, Tensor bases, int64_t group,
                     int64_t code_bits, MaybeTensor levels) {
    weights_.push_back({std::move(words), std::move(scales), std::move(offsets), std::move(bases),
                        group, code_bits, std::move(levels)});
    return static_cast<int64_t>(weights_.size()) - 1;
  }

  // A layer; with `router`, gate_up and down are expert stacks of `inter` rows each.
  void add_layer(Tensor input_norm, Tensor post_norm, std::vector<int64_t> qkv,
                 MaybeTensor qkv_bias, MaybeTensor q_norm, MaybeTensor k_norm, int64_t o,
                 int64_t gate_up, int64_t down, int64_t inter, MaybeTensor router, int64_t top_k,
                 bool renormalize, MaybeTensor attention_out_norm, MaybeTensor mlp_out_norm,
                 Tensor cos_sin, int64_t window, bool gelu, MaybeTensor sinks,
                 MaybeTensor o_bias, MaybeTensor router_bias, MaybeTensor up_bias,
                 MaybeTensor down_bias, double swiglu_alpha, double swiglu_limit,
                 int64_t shared_gate_up, int64_t shared_down, int64_t shared_inter,
                 MaybeTensor shared_gate, MaybeTensor choice_bias, double routed_scaling) {
    const int64_t count = static_cast<int64_t>(weights_.size());
    for (int64_t w : qkv) TORCH_CHECK(w >= 0 && w < count, "no weight ", w);
    TORCH_CHECK(!qkv.empty() && o >= 0 && o < count && gate_up >= 0 && gate_up < count &&
                    down >= 0 && down < count,
                "a layer names a weight not added");
    TORCH_CHECK(shared_gate_up < 0 || (router.has_value() && shared_gate_up < count &&
                                       shared_down >= 0 && shared_down < count),
                "a shared expert names a weight not added, or has no routed experts");
    TORCH_CHECK(!shared_gate.has_value() || shared_gate_up >= 0, "a shared gate with no expert");
    layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(qkv),
                       std::move(qkv_bias), std::move(q_norm), std::move(k_norm), o, gate_up,
                       down, inter, std::move(router), top_k, renormalize,
                       std::move(attention_out_norm), std::move(mlp_out_norm),
                       std::move(cos_sin), window, gelu, std::move(sinks), std::move(o_bias),
                       std::move(router_bias), std::move(up_bias), std::move(down_bias),
                       swiglu_alpha, swiglu_limit, shared_gate_up, shared_down, shared_inter,
                       std::move(shared_gate), std::move(choice_bias), routed_scaling});
  }

  // Every layer over the step's tokens `hidden` (their embeddings); returns the last layer's
  // output and the residual stream, which the model's final norm adds. `caches`: the pool's
  // layers, `table`, `rows` and `seq_lens` as decode_attention takes them. Layers with a
  // window write at `window_slots` and read through `window_table` (the sliding-window
  // layers' own pages; the same tensors as `slots` and `table` where they have none).
  std::tuple<Tensor, Tensor> run(Tensor hidden, Tensor positions, Tensor slots,
                                 Tensor window_slots, std::vector<Tensor> caches, Tensor table,
                                 Tensor window_table, Tensor rows, Tensor seq_lens) {
    static auto rmsnorm = op<Tensor(const Tensor&, const Tensor&, double)>("aserve_cpu::rmsnorm");
    static auto add_rmsnorm =
        op<void(Tensor, Tensor, const Tensor&, double)>("aserve_cpu::fused_add_rmsnorm");
    static auto norm_rope_store =
        op<void(Tensor, const Tensor&, const Tensor&, const Tensor&, const MaybeTensor&,
                const MaybeTensor&, double, Tensor, const Tensor&, int64_t)>(
            "aserve_cpu::norm_rope_store");
    static auto attention =
        op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                  double, int64_t, const std::optional<Tensor>&, double)>(
            "aserve_cpu::decode_attention");
    TORCH_CHECK(!layers_.empty() && caches.size() == layers_.size(), "one cache a layer");
    const int64_t tokens = hidden.size(0);
    Tensor residual = hidden;  // with post norms: the stream itself, which the layers read
    if (!post_norms_) hidden = rmsnorm.call(hidden.contiguous(), layers_[0].input_norm, eps_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (post_norms_) {
        if (i > 0) residual = hidden.add_(residual);
        hidden = residual;
      } else if (i > 0) {
        add_rmsnorm.call(hidden, residual, layer.input_norm, eps_);
      }
      const Tensor qkv = project(hidden, layer.qkv, layer.qkv_bias);
      const Tensor q = qkv.narrow(1, 0, q_size_);
      const bool windowed = layer.window > 0;
      const bool across_heads = norms_across_heads_ && layer.q_norm.has_value();
      if (across_heads) {
        norm_across_heads(q, *layer.q_norm);
        norm_across_heads(qkv.narrow(1, q_size_, kv_size_), *layer.k_norm);
      }
      norm_rope_store.call(q, qkv.narrow(1, q_size_, 2 * kv_size_), positions, layer.cos_sin,
                           across_heads ? std::nullopt : layer.q_norm,
                           across_heads ? std::nullopt : layer.k_norm, eps_, caches[i],
                           windowed ? window_slots : slots, head_dim_);
      const Tensor attended =
          attention.call(q.view({tokens, -1, head_dim_}), caches[i],
                         windowed ? window_table : table, rows, seq_lens, scale_, layer.window,
                         layer.sinks, softcap_);
      hidden = project(attended.view({tokens, -1}), {layer.o}, layer.o_bias);
      if (layer.attention_out_norm.has_value())
        hidden = rmsnorm.call(hidden, *layer.attention_out_norm, eps_);
      if (residual_scale_ != 1.0) hidden.mul_(residual_scale_);
      if (post_norms_) {
        residual = hidden.add_(residual);
        hidden = mlp(residual, layer);
        hidden = rmsnorm.call(hidden, *layer.mlp_out_norm, eps_);
        continue;
      }
      add_rmsnorm.call(hidden, residual, layer.post_norm, eps_);
      hidden = layer.router.has_value() ? experts(hidden, layer) : mlp(hidden, layer);
      if (layer.mlp_out_norm.has_value()) hidden = rmsnorm.call(hidden, *layer.mlp_out_norm, eps_);
      if (residual_scale_ != 1.0) hidden.mul_(residual_scale_);
    }
    return {hidden, residual};
  }

 private:
  // One RMSNorm over all heads of Q or K (`x`, a view in the QKV output), in place, with
  // layers/norm.py's AcrossHeadsNorm's ops (the same bits).
  void norm_across_heads(Tensor x, const Tensor& weight) const {
    const Tensor x32 = x.to(at::kFloat);
    const Tensor inv_rms = x32.pow(2).sum(-1, true).div_(x.size(1)).add_(eps_).rsqrt_();
    x.copy_(x32.mul(inv_rms).mul_(weight));
  }

  // x times each weight, outputs side by side, then the bias: as QuantizedLinearWeight and
  // NativeWeight.linear compute it for weights without padded rows (models/cpu_decode.py
  // takes no others).
  Tensor project(const Tensor& x, const std::vector<int64_t>& parts, const MaybeTensor& bias) {
    std::vector<Tensor> outputs;
    for (int64_t part : parts) outputs.push_back(linear(x, weights_[part]));
    Tensor y = outputs.size() == 1 ? outputs[0] : at::cat(outputs, -1);
    return bias.has_value() ? y.add(*bias) : y;
  }

  static Tensor linear(const Tensor& x, const Weight& w) {
    static auto product = op<WeightArgs>("aserve_cpu::linear");
    return product.call(x, w.words, w.scales, w.offsets, w.bases, w.group, w.code_bits,
                        w.levels);
  }

  // SiLU-gated: the activation in the gate|up product's own kernel; GELU (Gemma): the
  // product, then ATen's tanh GELU times up, as layers/cpu_ops.py's `gelu_tanh_and_mul`.
  Tensor mlp(const Tensor& x, const Layer& layer) {
    if (layer.gelu) {
      const std::vector<Tensor> halves = linear(x, weights_[layer.gate_up]).chunk(2, -1);
      return linear(at::gelu(halves[0], "tanh").mul_(halves[1]), weights_[layer.down]);
    }
    return gated_mlp(x, layer.gate_up, layer.down, layer.inter);
  }

  // The SiLU-gated MLP of weights `gate_up` and `down`, `inter` rows each half.
  Tensor gated_mlp(const Tensor& x, int64_t gate_up, int64_t down, int64_t inter) {
    static auto gated = op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, int64_t, int64_t, const MaybeTensor&, int64_t)>(
        "aserve_cpu::gated_linear");
    const Weight& w = weights_[gate_up];
    const Tensor activation = gated.call(x, w.words, w.scales, w.offsets, w.bases, w.group,
                                         w.code_bits, w.levels, inter);
    return linear(activation, weights_[down]);
  }

  Tensor experts(const Tensor& x, const Layer& layer) {
    static auto moe = op<Tensor(const Tensor&, const Tensor&, int64_t, bool, const Tensor&,
                                const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                                const MaybeTensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, int64_t, int64_t, const MaybeTensor&, int64_t,
                                const MaybeTensor&, const MaybeTensor&, const MaybeTensor&,
                                double, double, const MaybeTensor&, double)>(
        "aserve_cpu::moe_layer");
    const Weight& up = weights_[layer.gate_up];
    const Weight& down = weights_[layer.down];
    Tensor routed =
        moe.call(x.contiguous(), *layer.router, layer.top_k, layer.renormalize, up.words,
                 up.scales, up.offsets, up.bases, up.group, up.code_bits, up.levels, down.words,
                 down.scales, down.offsets, down.bases, down.group, down.code_bits, down.levels,
                 layer.inter, layer.router_bias, layer.up_bias, layer.down_bias,
                 layer.swiglu_alpha, layer.swiglu_limit, layer.choice_bias, layer.routed_scaling);
    if (layer.shared_gate_up < 0) return routed;
    // as layers/moe.py's SparseMoE: shared_expert(x), times sigmoid(shared_expert_gate(x))
    Tensor shared = gated_mlp(x, layer.shared_gate_up, layer.shared_down, layer.shared_inter);
    if (layer.shared_gate.has_value()) shared.mul_(at::linear(x, *layer.shared_gate).sigmoid_());
    return routed.add_(shared);
  }

  int64_t q_size_, kv_size_, head_dim_;
  double eps_, scale_, softcap_, residual_scale_;
  bool post_norms_, norms_across_heads_;
  std::vector<Weight> weights_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve_cpu, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, double, double, bool, bool>())
      .def("add_weight", &DecodeStack::add_weight)
      .def("add_layer", &DecodeStack::add_layer)
      .def("run", &DecodeStack::run);
}
