"""GNMT v2 (the MLPerf / NVIDIA DeepLearningExamples variant): an LSTM seq2seq translator.

Encoder: one bidirectional LSTM layer, then unidirectional layers with residual
connections from the third layer on. Decoder: an LSTM whose output attends (normalized
Bahdanau / additive attention) over the encoder outputs; the attention context is
concatenated to the input of every later decoder layer, again residual from the third.
Training uses teacher forcing: the target ids are the decoder input.

Each layer is its own ``nn.LSTM`` module so fxdream sees them as separate layers and a
pass can treat LSTMs as opaque, cuDNN-style kernels. Batch-first layout, no padding: all
sequences in the example batch have full length, so no packing or attention mask.

The full config keeps the real size (hidden 1024, 4 + 4 layers, 32k shared vocabulary,
50 tokens; 160,015,617 parameters, about the reference's 160M): a CPU training step at a
small batch is slow but feasible, so nothing is reduced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GNMTConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int          # per side: encoder LSTM layers, and decoder LSTM layers (attention LSTM included)
    seq_len: int             # source and target length of the example batch
    dropout: float = 0.2
    init_range: float = 0.1  # GNMT's uniform(-0.1, 0.1) init


CONFIGS = {
    ("gnmt", False): GNMTConfig(32000, 1024, 4, 50),
    ("gnmt", True): GNMTConfig(50, 16, 2, 6),
}


class ResidualRecurrentEncoder(nn.Module):
    def __init__(self, config: GNMTConfig, embedder: nn.Embedding):
        super().__init__()
        hidden = config.hidden_size
        self.embedder = embedder
        self.rnn_layers = nn.ModuleList([nn.LSTM(hidden, hidden, batch_first=True, bidirectional=True)])
        self.rnn_layers.append(nn.LSTM(2 * hidden, hidden, batch_first=True))
        for _ in range(config.num_layers - 2):
            self.rnn_layers.append(nn.LSTM(hidden, hidden, batch_first=True))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, src_ids: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.embedder(src_ids))
        x = self.rnn_layers[0](x)[0]                    # [B, S, 2H]: both directions
        x = self.rnn_layers[1](self.dropout(x))[0]      # back to [B, S, H]
        for lstm in self.rnn_layers[2:]:
            x = lstm(self.dropout(x))[0] + x
        return x


class BahdanauAttention(nn.Module):
    """score(q, k) = v . tanh(W_q q + W_k k + b), with v weight-normalized as in GNMT."""

    def __init__(self, query_size: int, key_size: int, num_units: int):
        super().__init__()
        self.linear_q = nn.Linear(query_size, num_units, bias=False)
        self.linear_k = nn.Linear(key_size, num_units, bias=False)
        self.linear_att = nn.Parameter(torch.empty(num_units))
        self.normalize_scalar = nn.Parameter(torch.empty(1))
        self.normalize_bias = nn.Parameter(torch.empty(num_units))

    def reset_normalization(self) -> None:
        nn.init.constant_(self.normalize_scalar, 1.0 / math.sqrt(self.linear_att.numel()))
        nn.init.zeros_(self.normalize_bias)

    def forward(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """query [B, T, Hq], keys [B, S, Hk] -> context [B, T, Hk]."""
        summed = self.linear_q(query).unsqueeze(2) + self.linear_k(keys).unsqueeze(1) + self.normalize_bias
        direction = self.linear_att / self.linear_att.norm() * self.normalize_scalar
        scores = torch.tanh(summed).matmul(direction)   # [B, T, S]
        return torch.bmm(F.softmax(scores, dim=-1), keys)


class RecurrentAttention(nn.Module):
    """The first decoder LSTM, whose outputs are the attention queries."""

    def __init__(self, hidden: int, dropout: float):
        super().__init__()
        self.rnn = nn.LSTM(hidden, hidden, batch_first=True)
        self.attn = BahdanauAttention(hidden, hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rnn_outputs = self.rnn(self.dropout(inputs))[0]
        return rnn_outputs, self.attn(rnn_outputs, context)


class ResidualRecurrentDecoder(nn.Module):
    def __init__(self, config: GNMTConfig, embedder: nn.Embedding):
        super().__init__()
        hidden = config.hidden_size
        self.embedder = embedder
        self.att_rnn = RecurrentAttention(hidden, config.dropout)
        self.rnn_layers = nn.ModuleList(
            nn.LSTM(2 * hidden, hidden, batch_first=True) for _ in range(config.num_layers - 1))
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(hidden, config.vocab_size)

    def forward(self, tgt_ids: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x, attention = self.att_rnn(self.embedder(tgt_ids), context)
        for i, lstm in enumerate(self.rnn_layers):
            out = lstm(self.dropout(torch.cat((x, attention), dim=2)))[0]
            x = out + x if i > 0 else out   # residual from the third decoder layer on
        return self.classifier(x)


class GNMT(nn.Module):
    def __init__(self, config: GNMTConfig):
        super().__init__()
        # One embedding for both sides (GNMT's joint BPE vocabulary, the reference default):
        # it appears as encoder.embedder and decoder.embedder but counts once.
        shared_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.encoder = ResidualRecurrentEncoder(config, shared_embedding)
        self.decoder = ResidualRecurrentDecoder(config, shared_embedding)
        for parameter in self.parameters():
            nn.init.uniform_(parameter, -config.init_range, config.init_range)
        self.decoder.att_rnn.attn.reset_normalization()

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: logits [B, T, vocab] for every target position."""
        return self.decoder(tgt_ids, self.encoder(src_ids))


def build_model(name: str, tiny: bool) -> GNMT:
    return GNMT(CONFIGS[name, tiny])


def example_batch(name: str, batch_size: int, tiny: bool, generator: torch.Generator):
    """((src_ids, tgt_ids), next-token labels [B, T])."""
    config = CONFIGS[name, tiny]
    shape = (batch_size, config.seq_len)
    src_ids = torch.randint(0, config.vocab_size, shape, generator=generator)
    tgt_ids = torch.randint(0, config.vocab_size, shape, generator=generator)
    labels = torch.randint(0, config.vocab_size, shape, generator=generator)
    return (src_ids, tgt_ids), labels
