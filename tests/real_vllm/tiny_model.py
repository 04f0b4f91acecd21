"""A tiny Llama built at test time: there is no model hub here, and none is needed.

Run inside the real tier's venv (``tests/real_vllm/environment.py``): random weights from
``transformers`` and a byte-level BPE tokenizer trained in a second with ``tokenizers`` on text
written below, with a chat template so that ``/v1/chat/completions`` and ``/v1/messages`` work.
The output is gibberish, which is all a router test needs: real tokens, a real KV cache, a real
NIXL handoff. Deterministic (a fixed seed), so the same folder is built every time; cached
beside the venv and built again only when this file changes (its hash names the folder).

Shape: 2 layers, hidden 128, 2 heads of 64 (a head size vLLM's CPU attention supports), a 2,048
token context, bfloat16. A 212-token prompt fills two KV blocks of 128.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
VOCAB = 1024
CONTEXT = 2048


def _corpus() -> list[str]:
    words = ("the router sends every prompt to a producer engine which computes its cache and hands "
             "the blocks to a consumer engine that streams tokens back to the client over http").split()
    lines = []
    for i in range(2000):
        lines.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) + f" {i}.")
    return lines


def build(target: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    target.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=CONTEXT)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(target)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=CONTEXT,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, torch_dtype="bfloat16",
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    # A generation config without sampling defaults: the engine's defaults stand.
    (target / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id}))


if __name__ == "__main__":
    build(Path(sys.argv[1]))
    print(f"tiny model written to {sys.argv[1]}")
