"""Hugging Face transformers models as users write them, for cpu_ab.py (``benchmarks/hf_models.py:bert``).

Random weights from a config (no download), sequence 128, outputs the last hidden state (one
tensor, so every runner compares alike):

* ``bert``: ``BertModel(BertConfig())``, bert-base-uncased's shape (110M parameters);
* ``llama``: ``LlamaModel`` of ~100M parameters (hidden 768, 12 layers, 12 heads, MLP 2048,
  vocabulary 32000), with its default SDPA attention;
* ``gpt2``: ``GPT2Model(GPT2Config())``, gpt2's shape (124M parameters), whose linear layers are
  ``Conv1D`` (weights stored as (in, out)) and whose GELU is written out with ``tanh``.

    python benchmarks/cpu_ab.py --models benchmarks/hf_models.py:bert,benchmarks/hf_models.py:llama --batches 1
    python benchmarks/cpu_ab.py --models benchmarks/hf_models.py:gpt2 --batches 1
"""
from __future__ import annotations

import torch

SEQUENCE = 128


class LastHidden(torch.nn.Module):
    """A transformers model called with input_ids, returning its last hidden state."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False, return_dict=False)[0]


def _ids(batch: int, vocabulary: int) -> torch.Tensor:
    return torch.randint(1, vocabulary, (batch, SEQUENCE), generator=torch.Generator().manual_seed(0))


def bert(batch: int):
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig()
    return LastHidden(transformers.BertModel(config)).eval(), (_ids(batch, config.vocab_size),)


def llama(batch: int):
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                      num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                                      max_position_embeddings=SEQUENCE)
    return LastHidden(transformers.LlamaModel(config)).eval(), (_ids(batch, config.vocab_size),)


def gpt2(batch: int):
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config()
    return LastHidden(transformers.GPT2Model(config)).eval(), (_ids(batch, config.vocab_size),)
