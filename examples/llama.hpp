// A LLaMA-style decoder in LibTorch, laid out as Hugging Face's
// LlamaForCausalLM (the same parameter names, so accel::save_model writes a
// model.safetensors that transformers loads as it is): token embedding,
// RMSNorm, rotary position embeddings, causal grouped-query attention,
// SwiGLU, an untied LM head.
//
// Context parallelism, DeepSpeed-Ulysses' way (LLaMA-Factory's sequence-
// parallel plugin): each rank of the cp group holds a contiguous slice of
// every sequence; attention exchanges heads for sequence with an
// all_to_all (each rank then holds every position of H/cp heads), runs as
// usual on the whole sequence, and exchanges back. accel::autograd's
// all_to_all carries the gradients back the same way.
//
// Tensor parallelism by torchtitan's plan (tp_plan below, applied with
// accel::tp::parallelize_module): every module the plan styles is called
// through accel::unit_forward, which applies its style (and, under
// FULL_SHARD, gathers a unit's parameters); unplanned, it is the module.
#pragma once

#define ACCEL_TRAINING
#include "accel.hpp"

#include <cmath>
#include <string>

namespace llama {

struct Config {
  int64_t vocab_size = 256, hidden_size = 128, intermediate_size = 352, num_hidden_layers = 4, num_attention_heads = 4,
          num_key_value_heads = 2, max_position_embeddings = 256;
  double rms_norm_eps = 1e-5, rope_theta = 10000.0;
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  // Hugging Face's config.json for LlamaForCausalLM with these sizes.
  std::string to_json() const {
    auto n = [](int64_t v) { return std::to_string(v); };
    auto d = [](double v) {
      std::ostringstream s;
      s.precision(17);
      s << v;
      return s.str();
    };
    return "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n  \"vocab_size\": " +
           n(vocab_size) + ",\n  \"hidden_size\": " + n(hidden_size) +
           ",\n  \"intermediate_size\": " + n(intermediate_size) +
           ",\n  \"num_hidden_layers\": " + n(num_hidden_layers) +
           ",\n  \"num_attention_heads\": " + n(num_attention_heads) +
           ",\n  \"num_key_value_heads\": " + n(num_key_value_heads) + ",\n  \"head_dim\": " + n(head_dim()) +
           ",\n  \"max_position_embeddings\": " + n(max_position_embeddings) +
           ",\n  \"rms_norm_eps\": " + d(rms_norm_eps) + ",\n  \"rope_theta\": " + d(rope_theta) +
           ",\n  \"hidden_act\": \"silu\",\n  \"attention_bias\": false,\n  \"mlp_bias\": false,\n"
           "  \"tie_word_embeddings\": false,\n  \"bos_token_id\": null,\n  \"eos_token_id\": null,\n"
           "  \"torch_dtype\": \"float32\"\n}\n";
  }
  // The sizes from a config.json (Hugging Face's field names; a missing
  // number keeps this default, as transformers' LlamaConfig).
  static Config from_json(const std::string& text) {
    Config c;
    auto number = [&](const std::string& key, auto& field) {
      const auto at = text.find("\"" + key + "\"");
      if (at == std::string::npos) return;
      const auto colon = text.find(':', at);
      field = static_cast<std::remove_reference_t<decltype(field)>>(std::stod(text.substr(colon + 1)));
    };
    number("vocab_size", c.vocab_size);
    number("hidden_size", c.hidden_size);
    number("intermediate_size", c.intermediate_size);
    number("num_hidden_layers", c.num_hidden_layers);
    number("num_attention_heads", c.num_attention_heads);
    number("num_key_value_heads", c.num_key_value_heads);
    number("max_position_embeddings", c.max_position_embeddings);
    number("rms_norm_eps", c.rms_norm_eps);
    number("rope_theta", c.rope_theta);
    const auto tied = text.find("\"tie_word_embeddings\"");
    if (tied != std::string::npos && text.compare(text.find_first_not_of(" :", text.find(':', tied)), 4, "true") == 0)
      throw std::invalid_argument("config.json: tie_word_embeddings is true; this model's LM head is its own (untied)");
    int64_t head_dim = c.head_dim();
    number("head_dim", head_dim);
    if (head_dim != c.head_dim())
      throw std::invalid_argument("config.json: head_dim " + std::to_string(head_dim) +
                                  " is not hidden_size / num_attention_heads (this model does not support that)");
    return c;
  }
};

// HF's LlamaRMSNorm: in float32, the weight applied in the input's dtype.
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t size, double eps) : eps(eps) { weight = register_parameter("weight", torch::ones({size})); }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = x.to(at::kFloat);
    return weight * (h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type());
  }
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

inline torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

// x: [B, T, h, d] -> [B, h, T, d] rotated by position (HF's rotate_half form).
inline at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor t = x.transpose(1, 2);
  const int64_t half = t.size(-1) / 2;
  const at::Tensor rotated = torch::cat({-t.narrow(-1, half, half), t.narrow(-1, 0, half)}, -1);
  return t * cos + rotated * sin;
}

// Ulysses' exchanges on the cp group, as accel::autograd::all_to_all along dim 0.
// to_heads: [B, T/cp, h, d] (a slice of the sequence, every head) -> [B, T, h/cp, d].
inline at::Tensor to_heads(const at::Tensor& x, const accel::GroupPtr& cp) {
  const int64_t P = cp->getSize(), B = x.size(0), Tl = x.size(1), h = x.size(2), d = x.size(3);
  const at::Tensor out = accel::autograd::all_to_all(x.permute({2, 0, 1, 3}).contiguous(), {}, {}, cp);
  // out: [P (sequence slice) x h/P, B, Tl, d]
  return out.view({P, h / P, B, Tl, d}).permute({2, 0, 3, 1, 4}).reshape({B, P * Tl, h / P, d});
}
// to_sequence: [B, T, h/cp, d] -> [B, T/cp, h, d], the inverse.
inline at::Tensor to_sequence(const at::Tensor& x, const accel::GroupPtr& cp) {
  const int64_t P = cp->getSize(), B = x.size(0), T = x.size(1), hl = x.size(2), d = x.size(3), Tl = T / P;
  const at::Tensor chunks = x.view({B, P, Tl, hl, d}).permute({1, 3, 0, 2, 4}).contiguous();  // [P, hl, B, Tl, d]
  const at::Tensor out = accel::autograd::all_to_all(chunks.view({P * hl, B, Tl, d}), {}, {}, cp);
  // out: [P (head group) x hl, B, Tl, d]
  return out.permute({1, 2, 0, 3});
}

// Rotary angles' cos and sin for positions [first, first + count): [count, head_dim].
inline std::pair<at::Tensor, at::Tensor> rotary(const Config& c, int64_t first, int64_t count, at::Device device) {
  const int64_t d = c.head_dim();
  const at::Tensor inv_freq = 1.0 / torch::pow(c.rope_theta, torch::arange(0, d, 2, torch::dtype(torch::kFloat)) / d);
  const at::Tensor freqs = torch::outer(torch::arange(first, first + count, torch::dtype(torch::kFloat)), inv_freq);
  const at::Tensor angles = torch::cat({freqs, freqs}, -1).to(device);
  return {angles.cos(), angles.sin()};
}

// Causal grouped-query attention: q [B, h, T, d] for the positions after the `past` ones, k and v [B, hk, past +
// T, d] for every position so far; each key/value head serves h / hk query heads (HF's repeat_kv). [B, T, h, d].
inline at::Tensor attend(const at::Tensor& q, at::Tensor k, at::Tensor v, int64_t past) {
  const int64_t h = q.size(1), hk = k.size(1), T = q.size(2);
  k = k.repeat_interleave(h / hk, 1);
  v = v.repeat_interleave(h / hk, 1);
  at::Tensor scores = torch::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(q.size(3)));
  const at::Tensor future = torch::ones({T, k.size(2)}, torch::dtype(torch::kBool).device(q.device())).triu(past + 1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  const at::Tensor weights = torch::softmax(scores.to(at::kFloat), -1).to(q.scalar_type());
  return torch::matmul(weights, v).transpose(1, 2);
}

// Greedy decoding's key/value cache: per layer, the rotated keys and the values of every position so far
// ([B, hk, positions, d]; undefined before the first call).
struct KVCache {
  explicit KVCache(int64_t layers) : keys(layers), values(layers) {}
  int64_t length() const { return keys.empty() || !keys[0].defined() ? 0 : keys[0].size(2); }
  std::vector<at::Tensor> keys, values;
};

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(const Config& c)
      : heads(c.num_attention_heads),
        kv_heads(c.num_key_value_heads),
        head_dim(c.head_dim()),
        q_proj(register_module("q_proj", linear(c.hidden_size, heads * head_dim))),
        k_proj(register_module("k_proj", linear(c.hidden_size, kv_heads * head_dim))),
        v_proj(register_module("v_proj", linear(c.hidden_size, kv_heads * head_dim))),
        o_proj(register_module("o_proj", linear(heads * head_dim, c.hidden_size))) {}
  // x: [B, T/cp, hidden] (this rank's slice); cos, sin: [T, head_dim] for the whole sequence. Under the tp
  // plan the projections hold heads / tp of the heads (q_proj's rows split by head): -1 below counts them.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const accel::GroupPtr& cp) {
    const int64_t B = x.size(0), Tl = x.size(1);
    at::Tensor q = accel::unit_forward(q_proj, x).view({B, Tl, -1, head_dim}),
               k = accel::unit_forward(k_proj, x).view({B, Tl, -1, head_dim}),
               v = accel::unit_forward(v_proj, x).view({B, Tl, -1, head_dim});
    if (cp) q = to_heads(q, cp), k = to_heads(k, cp), v = to_heads(v, cp);
    at::Tensor out = attend(rotate(q, cos, sin), rotate(k, cos, sin), v.transpose(1, 2), 0);  // [B, T, h, d]
    if (cp) out = to_sequence(out.contiguous(), cp);  // [B, T/cp, heads (/ tp), d]
    return accel::unit_forward(o_proj, out.reshape({B, Tl, -1}));
  }
  // Decoding (one process, the whole model): x [B, T, hidden] the positions after the cached ones (cos, sin
  // theirs); their keys and values join the cache.
  at::Tensor decode(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys,
                    at::Tensor& values) {
    const int64_t B = x.size(0), T = x.size(1), past = keys.defined() ? keys.size(2) : 0;
    const at::Tensor k = rotate(k_proj(x).view({B, T, kv_heads, head_dim}), cos, sin),
                     v = v_proj(x).view({B, T, kv_heads, head_dim}).transpose(1, 2);
    keys = past ? torch::cat({keys, k}, 2) : k;
    values = past ? torch::cat({values, v}, 2) : v;
    const at::Tensor q = rotate(q_proj(x).view({B, T, heads, head_dim}), cos, sin);
    return o_proj(attend(q, keys, values, past).reshape({B, T, -1}));
  }
  int64_t heads, kv_heads, head_dim;
  torch::nn::Linear q_proj, k_proj, v_proj, o_proj;
};
TORCH_MODULE(Attention);

struct MlpImpl : torch::nn::Module {
  MlpImpl(const Config& c)
      : gate_proj(register_module("gate_proj", linear(c.hidden_size, c.intermediate_size))),
        up_proj(register_module("up_proj", linear(c.hidden_size, c.intermediate_size))),
        down_proj(register_module("down_proj", linear(c.intermediate_size, c.hidden_size))) {}
  at::Tensor forward(const at::Tensor& x) {
    return accel::unit_forward(down_proj,
                               torch::silu(accel::unit_forward(gate_proj, x)) * accel::unit_forward(up_proj, x));
  }
  torch::nn::Linear gate_proj, up_proj, down_proj;
};
TORCH_MODULE(Mlp);

struct DecoderLayerImpl : torch::nn::Module {
  DecoderLayerImpl(const Config& c)
      : self_attn(register_module("self_attn", Attention(c))),
        mlp(register_module("mlp", Mlp(c))),
        input_layernorm(register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps))),
        post_attention_layernorm(register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, accel::GroupPtr cp) {
    const at::Tensor h = x + accel::unit_forward(self_attn, accel::unit_forward(input_layernorm, x), cos, sin, cp);
    return h + accel::unit_forward(mlp, accel::unit_forward(post_attention_layernorm, h));
  }
  at::Tensor decode(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys,
                    at::Tensor& values) {
    const at::Tensor h = x + self_attn->decode(input_layernorm(x), cos, sin, keys, values);
    return h + mlp(post_attention_layernorm(h));
  }
  Attention self_attn;
  Mlp mlp;
  RMSNorm input_layernorm, post_attention_layernorm;
};
TORCH_MODULE(DecoderLayer);

struct BodyImpl : torch::nn::Module {  // HF's LlamaModel ("model." in the names)
  BodyImpl(const Config& c)
      : embed_tokens(register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.hidden_size))),
        norm(register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps))) {
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(DecoderLayer(c));
    register_module("layers", layers);
  }
  torch::nn::Embedding embed_tokens;
  torch::nn::ModuleList layers;
  RMSNorm norm;
};
TORCH_MODULE(Body);

struct LlamaImpl : torch::nn::Module {  // HF's LlamaForCausalLM
  explicit LlamaImpl(const Config& c)
      : config(c),
        model(register_module("model", Body(c))),
        lm_head(register_module("lm_head", linear(c.hidden_size, c.vocab_size))) {
    // HF's _init_weights: normal(0, 0.02) for linear and embedding weights, RMSNorm's ones.
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters())
      if (p.key().find("norm") == std::string::npos) p.value().normal_(0, 0.02);
  }
  // ids: [B, T/cp] (this rank's slice of each sequence; `cp` the group that
  // holds the others, null without context parallelism). Logits [B, T/cp, V].
  // Each decoder layer and the embedding and head go through
  // accel::unit_forward (FULL_SHARD's units) and, with `recompute`, each
  // layer through accel::checkpoint.
  at::Tensor forward(const at::Tensor& ids, const accel::GroupPtr& cp = {}, bool recompute = false) {
    const int64_t P = cp ? cp->getSize() : 1;
    // Rotary angles for every position of the whole sequence (positions are global: rank r's slice starts at r*T/P).
    const auto [cos_all, sin_all] = rotary(config, 0, ids.size(1) * P, ids.device());
    const at::Tensor cos = cos_all, sin = sin_all;  // (plain names: a lambda below captures them)
    at::Tensor h = accel::unit_forward(model->embed_tokens, ids);
    for (const auto& layer : *model->layers) {
      DecoderLayer block(std::dynamic_pointer_cast<DecoderLayerImpl>(layer));
      auto run = [block, cos, sin, cp](const at::Tensor& x) mutable {  // by value: run again in the backward
        return accel::unit_forward(block, x, cos, sin, cp);
      };
      h = recompute ? accel::checkpoint(run, h) : run(h);
    }
    return accel::unit_forward(lm_head, accel::unit_forward(model->norm, h));
  }
  // Greedy decoding (one process, the model neither prepared nor parallelized): the `count` tokens that follow
  // `prompt` ([1, P]), each the most likely after the ones before; the prompt's keys and values computed once,
  // then one position per step against the cache (transformers' generate(do_sample=False)).
  std::vector<int64_t> generate(const at::Tensor& prompt, int64_t count) {
    torch::NoGradGuard no_grad;
    KVCache cache(config.num_hidden_layers);
    std::vector<int64_t> out;
    at::Tensor next = prompt;
    while (static_cast<int64_t>(out.size()) < count) {
      const auto [cos, sin] = rotary(config, cache.length(), next.size(1), next.device());
      at::Tensor h = model->embed_tokens(next);
      for (size_t i = 0; i < model->layers->size(); ++i)
        h = model->layers[i]->as<DecoderLayerImpl>()->decode(h, cos, sin, cache.keys[i], cache.values[i]);
      const at::Tensor logits = lm_head(model->norm(h.narrow(1, -1, 1)));  // the last position's
      out.push_back(logits.argmax(-1).item<int64_t>());
      next = torch::full({1, 1}, out.back(), torch::dtype(torch::kLong).device(prompt.device()));
    }
    return out;
  }
  Config config;
  Body model;
  torch::nn::Linear lm_head;
};
TORCH_MODULE(Llama);

// Pipeline parallelism (train_llama --pp): stage k of `stages` cut from a
// whole Llama as torchtitan's pipeline_llama cuts it: the decoder layers
// split evenly (the first stages take one more where they do not divide),
// the embedding on the first stage, the final norm and the head on the
// last. The stage holds the whole model's modules (the same parameters)
// under the whole model's names ("model.layers.5.mlp.up_proj.weight"), so
// is_unit, the tp plan's patterns and Hugging Face's names apply unchanged.
// Its forward takes token ids (the first stage) or hidden states, and gives
// hidden states or (the last stage) logits.
struct StageBodyImpl : torch::nn::Module {   // "model.": this stage's part of Body
  using torch::nn::Module::register_module;  // (StageImpl registers the whole model's modules here)
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleDict layers;  // by the whole model's layer index
  RMSNorm norm{nullptr};
};
TORCH_MODULE(StageBody);

struct StageImpl : torch::nn::Module {
  StageImpl(const Llama& whole, int k, int stages) : config(whole->config) {
    const int64_t L = config.num_hidden_layers, per = L / stages, extra = L % stages;
    if (per == 0)
      throw std::invalid_argument("llama::Stage: " + std::to_string(L) + " layers over " + std::to_string(stages) +
                                  " stages leaves a stage without one; use at least as many layers as stages");
    const int64_t from = k * per + std::min<int64_t>(k, extra), count = per + (k < extra ? 1 : 0);
    model = register_module("model", StageBody());
    if (k == 0) model->embed_tokens = model->register_module("embed_tokens", whole->model->embed_tokens);
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> mine;
    for (int64_t i = from; i < from + count; ++i)
      mine.emplace_back(std::to_string(i), whole->model->layers->ptr(static_cast<size_t>(i)));
    model->layers->update(mine);
    model->register_module("layers", model->layers);
    if (k == stages - 1) {
      model->norm = model->register_module("norm", whole->model->norm);
      lm_head = register_module("lm_head", whole->lm_head);
    }
  }
  // ids [B, T] or hidden states [B, T, H] (under tensor parallelism [B, T / sequence_shards, H]: this rank's
  // tokens, sequence parallelism's split; under context parallelism T is this rank's slice of the sequence, as
  // Llama::forward's); with `recompute`, each layer through accel::checkpoint.
  at::Tensor forward(const at::Tensor& x, bool recompute = false) {
    const int64_t slices = cp ? cp->getSize() : 1;  // (rotary angles are those of the whole sequence's positions)
    const int64_t length = (model->embed_tokens.is_empty() ? x.size(1) * sequence_shards : x.size(1)) * slices;
    const auto [cos_all, sin_all] = rotary(config, 0, length, x.device());
    const at::Tensor cos = cos_all, sin = sin_all;
    at::Tensor h = model->embed_tokens.is_empty() ? x : accel::unit_forward(model->embed_tokens, x);
    for (const auto& item : *model->layers) {
      DecoderLayer block(std::dynamic_pointer_cast<DecoderLayerImpl>(item.value()));
      auto run = [block, cos, sin, group = cp](const at::Tensor& in) mutable {
        return accel::unit_forward(block, in, cos, sin, group);
      };
      h = recompute ? accel::checkpoint(run, h) : run(h);
    }
    return lm_head.is_empty() ? h : accel::unit_forward(lm_head, accel::unit_forward(model->norm, h));
  }
  // The tp plan's entries for the modules this stage holds (the embedding's on the first, the norm's and the
  // head's on the last; every layer's pattern matches its layers).
  std::map<std::string, accel::tp::ParallelStyle> tp_plan_of(
      std::map<std::string, accel::tp::ParallelStyle> plan) const {
    if (model->embed_tokens.is_empty()) plan.erase("model.embed_tokens");
    if (lm_head.is_empty()) {
      plan.erase("model.norm");
      plan.erase("lm_head");
    }
    return plan;
  }
  Config config;
  StageBody model{nullptr};
  torch::nn::Linear lm_head{nullptr};
  int64_t sequence_shards = 1;  // the tp ranks a stage's hidden states are split over along the sequence
  accel::GroupPtr cp;           // context parallelism's group (Ulysses' attention), null without
};
TORCH_MODULE(Stage);

// Tensor parallelism: torchtitan's plan for Llama (parallelize_llama) under
// Hugging Face's names, sequence parallelism included. The residual stream
// between blocks is split along the sequence (Shard(1)), the norms run on
// this rank's tokens; attention and the MLP all-gather their input
// (PrepareModuleInput), q/k/v and gate/up split by rows (heads, features),
// o and down by columns with a reduce-scatter back to the sequence split;
// the embedding's rows (the vocabulary) split, the head's rows too: its
// logits are this rank's columns of the vocabulary, for
// accel::tp::vocab_parallel_cross_entropy (torch's loss_parallel).
inline std::map<std::string, accel::tp::ParallelStyle> tp_plan() {
  using namespace accel::tp;
  return {
      {"model.embed_tokens", RowwiseParallel{.input_layouts = Replicate{}, .output_layouts = Shard{1}}},
      {"model.layers.*.input_layernorm", SequenceParallel{}},
      {"model.layers.*.self_attn",
       PrepareModuleInput{{Shard{1}, std::nullopt, std::nullopt}, {Replicate{}, std::nullopt, std::nullopt}}},
      {"model.layers.*.self_attn.q_proj", ColwiseParallel{}},
      {"model.layers.*.self_attn.k_proj", ColwiseParallel{}},
      {"model.layers.*.self_attn.v_proj", ColwiseParallel{}},
      {"model.layers.*.self_attn.o_proj", RowwiseParallel{.output_layouts = Shard{1}}},
      {"model.layers.*.post_attention_layernorm", SequenceParallel{}},
      {"model.layers.*.mlp", PrepareModuleInput{{Shard{1}}, {Replicate{}}}},
      {"model.layers.*.mlp.gate_proj", ColwiseParallel{}},
      {"model.layers.*.mlp.up_proj", ColwiseParallel{}},
      {"model.layers.*.mlp.down_proj", RowwiseParallel{.output_layouts = Shard{1}}},
      {"model.norm", SequenceParallel{}},
      {"lm_head", ColwiseParallel{.input_layouts = Shard{1}, .output_layouts = Shard{-1}}},
  };
}

// FULL_SHARD's units (auto_wrap_policy): each decoder layer, the embedding,
// the final norm and the head.
inline bool is_unit(const std::string& name) {
  if (name == "model.embed_tokens" || name == "model.norm" || name == "lm_head") return true;
  return name.starts_with("model.layers.") && name.find('.', 13) == std::string::npos;
}

}  // namespace llama
