"""transformers' LlamaForCausalLM against examples/train_llama (tests/llama_check.sh).

    llama_check.py make DIR SEQ     a randomly initialised LlamaForCausalLM saved to DIR (Hugging Face's layout)
    llama_check.py compare DIR SEQ LOGITS
                                    the model in DIR (written by C++ or by `make`) loaded by transformers; its
                                    logits on train_llama's fixed input must equal LOGITS (float32, [1, SEQ, V])
    llama_check.py generate DIR PROMPT N LOG
                                    transformers' greedy generate(do_sample=False) of N tokens after PROMPT's bytes
                                    with the model in DIR must give the ids train_llama --generate printed in LOG
    llama_check.py dcp CHECKPOINT DIR
                                    Python's torch.distributed.checkpoint reads train_llama's save_state CHECKPOINT
                                    (each process's pieces, as safetensors with DCP_SHARDING_INFO) into a
                                    LlamaForCausalLM of DIR's config.json: every tensor must equal DIR's export
"""
import sys

import numpy as np
import torch
import transformers

SENTENCE = b"The quick brown fox jumps over the lazy dog. "
TOLERANCE = 1e-4  # float32: the same operations, in another library's order


def fixed_input(seq):
    return torch.tensor([[SENTENCE[i % len(SENTENCE)] for i in range(seq)]], dtype=torch.long)


def make(directory, seq):
    """A randomly initialised LlamaForCausalLM (llama_check.sh's sizes) saved to directory."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq,
                                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    print(f"llama_check: a LlamaForCausalLM initialised by transformers {transformers.__version__} in {directory}")


def generate(directory, prompt, count, log):
    model = transformers.LlamaForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, do_sample=False,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    expected = out.sequences[0, ids.shape[1]:].tolist()
    # The smallest gap between the chosen token's score and the next best: how close a step came to a tie.
    margin = min(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores)
    got = [int(v) for line in open(log) if "generated ids" in line for v in line.split("generated ids")[1].split()]
    print(f"llama_check: transformers' greedy generate of {count} tokens after {prompt!r}: "
          f"{bytes(expected)!r}; C++ {'the same' if got == expected else bytes(got)!r} "
          f"(smallest margin between the best two logits {margin:.3g})")
    if got != expected:
        sys.exit(1)


def dcp(checkpoint, directory):
    """dcp.load of a save_state checkpoint into transformers' model, against the same run's export."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from safetensors.torch import load_file

    config = transformers.LlamaConfig.from_pretrained(directory)
    torch.manual_seed(2)  # weights unlike the saved ones: the load must replace every one
    model = transformers.LlamaForCausalLM(config)
    state = model.state_dict()
    dcp.load(state, storage_reader=HuggingFaceStorageReader(checkpoint))
    expected = load_file(f"{directory}/model.safetensors")
    assert sorted(expected) == sorted(state), (sorted(expected), sorted(state))
    for name, values in expected.items():
        if not torch.equal(state[name], values):
            sys.exit(f"llama_check: {name}: DCP read {state[name]} from {checkpoint}; the export holds {values}")
    print(f"llama_check: torch {torch.__version__}'s dcp.load read {len(expected)} tensors of {checkpoint} into "
          "transformers' LlamaForCausalLM, each equal to the export's")


def main():
    mode, directory = sys.argv[1], sys.argv[2]
    if mode == "dcp":
        dcp(directory, sys.argv[3])
        return
    if mode == "generate":
        generate(directory, sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    seq = int(sys.argv[3])
    if mode == "make":
        make(directory, seq)
        return
    model = transformers.LlamaForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                          dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        expected = model(fixed_input(seq)).logits.float().numpy()
    got = np.fromfile(sys.argv[4], dtype=np.float32).reshape(expected.shape)
    difference = float(np.abs(got - expected).max())
    print(f"llama_check: transformers {transformers.__version__} loaded {directory}; largest logit difference to "
          f"C++ {difference:.3g} (logits up to {float(np.abs(expected).max()):.3g}; tolerance {TOLERANCE})")
    if not difference < TOLERANCE:
        sys.exit(1)


if __name__ == "__main__":
    main()
