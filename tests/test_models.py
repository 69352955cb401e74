"""The model zoo: every tiny model trains one step; builds are deterministic and side-effect free."""
import pytest
import torch
from torch import nn

from fxdream import models
from fxdream.models import gnmt

TINY_OUTPUT_SHAPES = {
    "resnet18": (2, 10),
    "resnet50": (2, 10),
    "vgg19": (2, 10),
    "densenet121": (2, 10),
    "mnist_convnet": (2, 10),
    "bert_base": (2, 2),
    "gnmt": (2, 6, 50),
}


def test_names_cover_every_model():
    assert set(models.NAMES) == set(TINY_OUTPUT_SHAPES)


@pytest.mark.parametrize("name", models.NAMES)
def test_tiny_model_trains_one_step(name):
    model, inputs, loss_fn = models.build(name, 2, tiny=True)
    assert model.training
    assert isinstance(inputs, tuple) and all(isinstance(t, torch.Tensor) for t in inputs)
    assert all(t.shape[0] == 2 for t in inputs)

    output = model(*inputs)
    assert tuple(output.shape) == TINY_OUTPUT_SHAPES[name]
    loss = loss_fn(output)
    assert loss.dim() == 0 and torch.isfinite(loss)

    loss.backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("name", models.NAMES)
def test_build_is_deterministic(name):
    model_a, inputs_a, loss_a = models.build(name, 2, tiny=True)
    model_b, inputs_b, loss_b = models.build(name, 2, tiny=True)
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key
    assert len(inputs_a) == len(inputs_b)
    for a, b in zip(inputs_a, inputs_b):
        assert torch.equal(a, b)
    # Same labels too: the two losses agree on the same output.
    model_a.eval()
    with torch.no_grad():
        output = model_a(*inputs_a)
    assert torch.equal(loss_a(output), loss_b(output))


def test_weights_are_not_all_equal_across_layers():
    """A seed per build, not per layer: two same-shape layers still differ."""
    model, _, _ = models.build("resnet18", 1, tiny=True)
    assert not torch.equal(model.layer1[0].conv1.weight, model.layer1[0].conv2.weight)


def test_build_leaves_global_rng_untouched():
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    expected = torch.rand(4)
    torch.set_rng_state(state)
    for name in models.NAMES:
        models.build(name, 1, tiny=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(torch.rand(4), expected)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as error:
        models.build("resnet1000", 2, tiny=True)
    message = str(error.value)
    assert "resnet1000" in message
    for name in models.NAMES:
        assert name in message


@pytest.mark.parametrize("batch_size", [0, -3])
def test_bad_batch_size(batch_size):
    with pytest.raises(ValueError) as error:
        models.build("resnet18", batch_size, tiny=True)
    message = str(error.value)
    assert "batch_size" in message and str(batch_size) in message
    for name in models.NAMES:
        assert name in message


def test_dtype_applies_to_floats_but_token_ids_stay_long():
    model, inputs, loss_fn = models.build("bert_base", 2, tiny=True, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    (input_ids,) = inputs
    assert input_ids.dtype == torch.long
    assert loss_fn(model(*inputs)).dtype == torch.float32

    _, (src_ids, tgt_ids), _ = models.build("gnmt", 2, tiny=True, dtype=torch.float64)
    assert src_ids.dtype == tgt_ids.dtype == torch.long

    model, (images,), _ = models.build("mnist_convnet", 3, dtype=torch.float64)
    assert images.dtype == torch.float64 and images.shape == (3, 1, 28, 28)


@pytest.mark.parametrize("name", models.NAMES)
def test_meta_device_builds_without_memory(name):
    model, inputs, _ = models.build(name, 2, tiny=True, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(t.is_meta for t in inputs)


VISION_QUALIFIED_NAMES = {
    "resnet18": ["conv1", "bn1", "relu", "maxpool", "layer1.0.conv1", "layer1.0.bn2",
                 "layer2.0.downsample.0", "layer2.0.downsample.1", "layer4.0.conv2", "avgpool", "fc"],
    "resnet50": ["layer1.0.downsample.0", "layer1.0.conv3", "layer1.0.bn3", "layer4.0.downsample.1", "fc"],
    "vgg19": ["features.0", "features.1", "features.4", "features.34", "features.36",
              "avgpool", "classifier.0", "classifier.2", "classifier.6"],
    "densenet121": ["features.conv0", "features.norm0", "features.relu0", "features.pool0",
                    "features.denseblock1.denselayer1.norm1", "features.denseblock1.denselayer1.relu1",
                    "features.denseblock1.denselayer1.conv1", "features.denseblock1.denselayer2.conv2",
                    "features.transition1.norm", "features.transition1.conv", "features.transition3.pool",
                    "features.denseblock4.denselayer2.norm2", "features.norm5", "classifier"],
}


@pytest.mark.parametrize("name", sorted(VISION_QUALIFIED_NAMES))
def test_vision_models_use_torchvision_names(name):
    model, _, _ = models.build(name, 1, tiny=True, device="meta")
    modules = dict(model.named_modules())
    for qualified_name in VISION_QUALIFIED_NAMES[name]:
        assert qualified_name in modules, qualified_name


def test_vgg_and_resnet_module_types():
    vgg, _, _ = models.build("vgg19", 1, tiny=True, device="meta")
    convs = [m for m in vgg.features if isinstance(m, nn.Conv2d)]
    assert len(convs) == 16 and all(c.bias is not None for c in convs)
    assert sum(isinstance(m, nn.MaxPool2d) for m in vgg.features) == 5
    assert all(m.inplace for m in vgg.features if isinstance(m, nn.ReLU))

    resnet, _, _ = models.build("resnet50", 1, tiny=True, device="meta")
    assert isinstance(resnet.relu, nn.ReLU) and resnet.relu.inplace
    assert all(m.bias is None for m in resnet.modules() if isinstance(m, nn.Conv2d))


def test_mnist_convs_have_bias_and_relu():
    model, _, _ = models.build("mnist_convnet", 1)
    layers = list(model.features)
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Conv2d):
            assert layer.bias is not None
            assert isinstance(layers[i + 1], nn.ReLU)
    assert model.classifier.in_features == 288


def test_bert_attention_is_explicit_matmul_softmax():
    model, inputs, _ = models.build("bert_base", 2, tiny=True)
    traced = torch.fx.symbolic_trace(model)
    targets = [node.target for node in traced.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.matmul) == 2 * 2  # two per layer, two layers
    assert torch.softmax in targets
    assert torch.nn.functional.scaled_dot_product_attention not in targets
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(m.p == 0.1 for m in dropouts)


def test_gnmt_residual_layers_train():
    """The tiny config has 2 layers, so exercise the residual 3rd+ layers at 4 layers here."""
    config = gnmt.GNMTConfig(vocab_size=20, hidden_size=8, num_layers=4, seq_len=5)
    model = gnmt.GNMT(config)
    assert sum(isinstance(m, nn.LSTM) for m in model.modules()) == 8
    assert model.encoder.rnn_layers[0].bidirectional
    assert model.encoder.embedder is model.decoder.embedder
    ids = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(0))
    logits = model(ids, ids)
    assert logits.shape == (3, 5, 20)
    logits.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


FULL_PARAMETER_COUNTS = {
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "vgg19": 143_667_240,
    "densenet121": 7_978_856,
    "mnist_convnet": 16_938,
    "bert_base": 109_483_778,   # encoder 109,482,240 + a 2-label classifier
    "gnmt": 160_015_617,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", models.NAMES)
def test_full_parameter_counts(name):
    model, inputs, _ = models.build(name, 2, device="meta")
    assert sum(p.numel() for p in model.parameters()) == FULL_PARAMETER_COUNTS[name]
    assert all(t.is_meta for t in inputs)


@pytest.mark.slow
def test_full_bert_encoder_sizes():
    model, (input_ids,), _ = models.build("bert_base", 2, device="meta")
    assert input_ids.shape == (2, 128) and input_ids.dtype == torch.long
    bert = model.bert
    assert sum(p.numel() for p in bert.parameters()) == 109_482_240
    assert sum(p.numel() for p in bert.encoder.parameters()) == 12 * 7_087_872
    assert bert.embeddings.word_embeddings.weight.shape == (30522, 768)
    assert bert.embeddings.position_embeddings.weight.shape == (512, 768)
    assert len(bert.encoder.layer) == 12
    layer = bert.encoder.layer[0]
    assert layer.attention.self.num_heads == 12
    assert layer.intermediate.dense.out_features == 3072
