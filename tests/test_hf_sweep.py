"""Hugging Face models as users call them (tiny configs, random weights, no downloads), through
``optimize`` with their keyword inputs: inference and training equal to eager, nothing printed
on stderr, a consistent report. Slow; needs ``transformers`` (the ``hf`` extra)."""
import pytest
import torch
import torch.utils._pytree as pytree

import fxdream

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def _text(batch=2, seq=12, vocab=100):
    return torch.randint(0, vocab, (batch, seq)), torch.ones(batch, seq, dtype=torch.long)


def bert():
    ids, mask = _text()
    config = transformers.BertConfig(vocab_size=100, max_position_embeddings=64, **SMALL)
    return transformers.BertForSequenceClassification(config), dict(input_ids=ids, attention_mask=mask,
                                                                     labels=torch.tensor([0, 1]))


def gpt2():
    ids, mask = _text()
    config = transformers.GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), dict(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)


def llama():
    ids, mask = _text()
    config = transformers.LlamaConfig(vocab_size=100, max_position_embeddings=64, num_key_value_heads=1, **SMALL)
    return transformers.LlamaForCausalLM(config), dict(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)


def t5():
    ids, mask = _text()
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0, use_cache=False)
    return transformers.T5ForConditionalGeneration(config), dict(input_ids=ids, attention_mask=mask,
                                                                 decoder_input_ids=ids[:, :6].contiguous(),
                                                                 labels=ids[:, 1:7].contiguous())


def vit():
    config = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, num_labels=3, **SMALL)
    return transformers.ViTForImageClassification(config), dict(pixel_values=torch.randn(2, 3, 16, 16),
                                                                labels=torch.tensor([0, 2]))


def beit():
    """Rebuilds its relative position index with in-place slice writes on every call."""
    config = transformers.BeitConfig(image_size=16, patch_size=8, num_channels=3, num_labels=3,
                                     use_relative_position_bias=True, **SMALL)
    return transformers.BeitForImageClassification(config), dict(pixel_values=torch.randn(2, 3, 16, 16),
                                                                  labels=torch.tensor([0, 2]))


MODELS = [bert, gpt2, llama, t5, vit, beit]


def _loss_or_sum(out):
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    return sum(t.float().sum() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad)


@pytest.mark.slow
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("make", MODELS, ids=[m.__name__ for m in MODELS])
def test_equal_to_eager_and_quiet(make, training, capfd):
    torch.manual_seed(0)
    model, inputs = make()
    model.train(training)
    if not training:
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
    capfd.readouterr()
    optimized = fxdream.optimize(model, example_kwargs=inputs, training=training, passes="auto")
    assert capfd.readouterr().err == ""
    report = optimized.report
    assert report.fallback_reason is None or report.ran_eagerly_as_measured_slower, report.fallback_reason
    results = []
    for module in (optimized, model):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(1)
        with torch.set_grad_enabled(training):
            out = module(**inputs)
        grads = []
        if training:
            _loss_or_sum(out).backward()
            grads = [p.grad for p in model.parameters()]
        results.append((pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out), grads))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-5)
    for got, want in zip(results[0][1], results[1][1]):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
