"""BERT-base for sequence classification, with Hugging Face's module names.

Attention is spelled out as matmul / softmax / matmul (no fused SDPA) so the captured
graph shows the two batched matmuls and the softmax between them, which is what
attention-fusion passes look for. No attention mask: every token of the example batch is
real, which keeps the graph free of mask arithmetic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    seq_len: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    num_labels: int = 2
    dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0


CONFIGS = {
    ("bert_base", False): BertConfig(30522, 768, 12, 12, 3072, seq_len=128, max_position_embeddings=512),
    ("bert_base", True): BertConfig(100, 32, 2, 2, 64, seq_len=16, max_position_embeddings=32),
}


class BertEmbeddings(nn.Module):
    """Sum of word, position and token-type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        # Buffers rather than per-call arange/zeros, as in Hugging Face: a single sentence
        # segment, so every token type is 0.
        positions = torch.arange(config.max_position_embeddings).unsqueeze(0)
        self.register_buffer("position_ids", positions, persistent=False)
        self.register_buffer("token_type_ids", torch.zeros_like(positions), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.size(1)
        # narrow rather than [:, :seq_len], so torch.fx.symbolic_trace can follow it too.
        embeddings = (self.word_embeddings(input_ids)
                      + self.position_embeddings(torch.narrow(self.position_ids, 1, 0, seq_len))
                      + self.token_type_embeddings(torch.narrow(self.token_type_ids, 1, 0, seq_len)))
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_size = config.hidden_size // config.num_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, H] -> [B, heads, S, H / heads]."""
        return x.view(x.size(0), x.size(1), self.num_heads, self.head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        query = self.split_heads(self.query(hidden_states))
        key = self.split_heads(self.key(hidden_states))
        value = self.split_heads(self.value(hidden_states))
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_size)
        probs = self.dropout(torch.softmax(scores, dim=-1))
        context = torch.matmul(probs, value).permute(0, 2, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), self.num_heads * self.head_size)


class BertSelfOutput(nn.Module):
    """Projection back to the residual stream, then Add & LayerNorm."""

    def __init__(self, config: BertConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden_states), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(hidden_states))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        # Hugging Face calls this BertOutput; it has the same shape as BertSelfOutput.
        self.output = BertSelfOutput(config, config.intermediate_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attention_output = self.attention(hidden_states)
        return self.output(self.intermediate(attention_output), attention_output)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states)
        return hidden_states


class BertPooler(nn.Module):
    """tanh(dense(first token)): the sentence summary the classifier reads."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))


class BertModel(nn.Module):
    """The encoder proper: what "BERT-base, 110M parameters" counts."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.pooler(self.encoder(self.embeddings(input_ids)))


class BertForSequenceClassification(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.bert = BertModel(config)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self._init_weights(config.initializer_range)

    def _init_weights(self, std: float) -> None:
        """Hugging Face's init: N(0, 0.02) weights, zero biases, zero padding embedding."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding) and m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.bert(input_ids)))


def build_model(name: str, tiny: bool) -> BertForSequenceClassification:
    return BertForSequenceClassification(CONFIGS[name, tiny])


def example_batch(name: str, batch_size: int, tiny: bool, generator: torch.Generator):
    """((input_ids,), sentence labels); ids avoid 0 so no token is padding."""
    config = CONFIGS[name, tiny]
    input_ids = torch.randint(1, config.vocab_size, (batch_size, config.seq_len), generator=generator)
    labels = torch.randint(0, config.num_labels, (batch_size,), generator=generator)
    return (input_ids,), labels
