// A GPT-2-shaped decoder, shared by the training tests (through
// training_fixtures.hpp) and the sharding benchmark (bench_sharding.cpp's
// gpt variants), so that both measure and check the same model. It includes
// nothing: the includer brings accel first (the tests the parts under
// include/accel/, the benchmark the generated accel.hpp), and <cmath> and
// <limits>.
#pragma once

namespace training_fixtures {
// A GPT-2-shaped decoder, as Hugging Face's GPT2LMHeadModel names its
// tensors (transformer.wte, transformer.h.<i>.attn.c_attn, ..., lm_head):
// token and position embeddings, `layers` identical pre-norm blocks (causal
// self-attention, a 4x MLP with GELU's tanh form), a final norm and a head
// without bias. tied: the head's weight is the token embedding's, one
// tensor registered under both names (transformer.wte.weight,
// lm_head.weight), as GPT-2 ties them. Every layer goes through
// accel::unit_forward (a plain call where it is no unit); `recompute`
// wraps each block in accel::checkpoint. Linear weights are [out, in];
// GPT-2's own files hold Conv1D's [in, out] (the export test transposes).
// tests/python_ref/fsdp2_ref.py's Gpt is the same model in Python.
struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(int64_t width, int64_t heads) : heads(heads) {
    ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}).eps(1e-5)));
    attn = register_module("attn", std::make_shared<torch::nn::Module>());
    c_attn = attn->register_module("c_attn", torch::nn::Linear(width, 3 * width));
    attn_proj = attn->register_module("c_proj", torch::nn::Linear(width, width));
    ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}).eps(1e-5)));
    mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
    c_fc = mlp->register_module("c_fc", torch::nn::Linear(width, 4 * width));
    mlp_proj = mlp->register_module("c_proj", torch::nn::Linear(4 * width, width));
  }
  at::Tensor forward(const at::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), D = C / heads;
    const at::Tensor qkv = accel::unit_forward(c_attn, accel::unit_forward(ln_1, x));
    auto split = [&](int64_t i) { return qkv.narrow(2, i * C, C).view({B, T, heads, D}).transpose(1, 2); };
    const at::Tensor q = split(0), k = split(1), v = split(2);
    const at::Tensor causal = at::ones({T, T}, at::TensorOptions(at::kBool)).triu(1);
    const at::Tensor scores = q.matmul(k.transpose(-2, -1)).mul(1.0 / std::sqrt(static_cast<double>(D)));
    const at::Tensor y = scores.masked_fill(causal, -std::numeric_limits<double>::infinity())
                             .softmax(-1)
                             .matmul(v)
                             .transpose(1, 2)
                             .reshape({B, T, C});
    const at::Tensor h = x + accel::unit_forward(attn_proj, y);
    const at::Tensor up = accel::unit_forward(c_fc, accel::unit_forward(ln_2, h));
    return h + accel::unit_forward(mlp_proj, at::gelu(up, "tanh"));
  }
  int64_t heads;
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  std::shared_ptr<torch::nn::Module> attn, mlp;
  torch::nn::Linear c_attn{nullptr}, attn_proj{nullptr}, c_fc{nullptr}, mlp_proj{nullptr};
};
TORCH_MODULE(GptBlock);
// The head: a weight of its own, or (tied) the token embedding's tensor
// itself, registered here a second time. (LibTorch's Linear cannot take
// another's tensor: its weight is registered when it is made.)
struct GptHeadImpl : torch::nn::Module {
  explicit GptHeadImpl(at::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight); }
  at::Tensor weight;
};
TORCH_MODULE(GptHead);
struct GptOptions {
  int64_t vocab = 64, positions = 16, width = 32, heads = 2, layers = 3;
  bool tied = true;
};
struct GptImpl : torch::nn::Module {
  explicit GptImpl(GptOptions o = {}) : options(o) {
    transformer = register_module("transformer", std::make_shared<torch::nn::Module>());
    wte = transformer->register_module("wte", torch::nn::Embedding(o.vocab, o.width));
    wpe = transformer->register_module("wpe", torch::nn::Embedding(o.positions, o.width));
    h = transformer->register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < o.layers; ++i) {
      blocks.push_back(GptBlock(o.width, o.heads));
      h->push_back(blocks.back());
    }
    ln_f = transformer->register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.width}).eps(1e-5)));
    lm_head = register_module("lm_head", GptHead(o.tied ? wte->weight : at::empty({o.vocab, o.width})));
    torch::NoGradGuard no_grad;  // GPT-2's initialisation: N(0, 0.02) weights, zero biases
    for (auto& p : named_parameters())
      if (p.key().ends_with(".bias")) p.value().zero_();
      else if (p.key().find("ln_") == std::string::npos) p.value().normal_(0, 0.02);
  }
  // tokens: [batch, time] int64; the logits, [batch, time, vocab], in the dtype the head computed in.
  at::Tensor forward(const at::Tensor& tokens) {
    const at::Tensor positions = at::arange(tokens.size(1), at::TensorOptions(at::kLong));
    at::Tensor x = accel::unit_forward(wte, tokens) + accel::unit_forward(wpe, positions);
    for (auto& block : blocks)
      x = recompute ? accel::checkpoint([block](const at::Tensor& in) mutable { return accel::unit_forward(block, in); },
                                        x)
                    : accel::unit_forward(block, x);
    return accel::unit_forward(lm_head, accel::unit_forward(ln_f, x));
  }
  GptOptions options;
  bool recompute = false;
  std::shared_ptr<torch::nn::Module> transformer;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  std::vector<GptBlock> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  GptHead lm_head{nullptr};
};
TORCH_MODULE(Gpt);
// The mean next-token cross entropy of `logits` (any floating dtype: computed in float32).
inline at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  const at::Tensor predicted = logits.narrow(1, 0, T - 1).to(at::kFloat);
  return torch::cross_entropy_loss(predicted.reshape({-1, predicted.size(2)}),
                                   tokens.narrow(1, 1, T - 1).reshape({-1}));
}
// Gpt's units by block (transformer.h.<i>), the way a user of FSDP wraps a transformer.
inline bool gpt_blocks(const std::string& name, const torch::nn::Module&) {
  return name.starts_with("transformer.h.") && name.find('.', 14) == std::string::npos;
}
}  // namespace training_fixtures
