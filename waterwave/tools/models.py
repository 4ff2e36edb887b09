"""Models the planner CLI and benchmark know by name, with example inputs.

torchvision classification, video and ViT models are built untrained (the
ones named here, and any other torchvision image classifier by its name); the
transformers models (BERT-base, GPT-2, XLM-R-base) are built from their
default configurations, so nothing is downloaded.
"""
from __future__ import annotations

TORCHVISION = ("alexnet", "vgg16", "resnet18", "resnet50", "mobilenet_v2", "mnasnet1_0",
               "efficientnet_b0", "inception_v3", "vit_b_16", "r3d_18")
TRANSFORMERS = {"bert-base": "bert", "gpt2": "gpt2", "xlm-roberta-base": "xlmr"}
SEQ_LEN = 128


def names() -> list[str]:
    return list(TORCHVISION) + list(TRANSFORMERS)


def build(name: str, batch_size: int, device: str = "cpu"):
    """Returns (model, example_inputs, loss_fn), with the model, inputs and
    targets on ``device``."""
    model, inputs, loss = _build(name, batch_size, device)
    return model.to(device), inputs, loss


def is_known(name: str) -> bool:
    return name in TORCHVISION or name in TRANSFORMERS or _torchvision_classifier(name)


def _torchvision_classifier(name: str) -> bool:
    """Any other torchvision image classifier, by its name (224x224 inputs)."""
    try:
        import torchvision
    except ImportError:
        return False
    return name in torchvision.models.list_models(module=torchvision.models)


def _build(name: str, batch_size: int, device: str):
    import torch

    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    if name in TORCHVISION or _torchvision_classifier(name):
        import torchvision

        if name == "r3d_18":
            model = torchvision.models.video.r3d_18()
            x = torch.randn(batch_size, 3, 16, 112, 112, device=device)
        elif name == "inception_v3":
            model = torchvision.models.inception_v3(aux_logits=False, init_weights=False)
            x = torch.randn(batch_size, 3, 299, 299, device=device)
        else:
            model = torchvision.models.get_model(name)
            x = torch.randn(batch_size, 3, 224, 224, device=device)
        target = torch.randint(0, 1000 if name != "r3d_18" else 400, (batch_size,), device=device)
        loss = torch.nn.CrossEntropyLoss()
        return model, (x,), lambda out: loss(out, target)
    if name in TRANSFORMERS:
        try:
            import transformers
        except ImportError as e:
            raise ValueError(f"model {name!r} needs the transformers package: "
                             "pip install 'transformers>=4.40'") from e
        kind = TRANSFORMERS[name]
        if kind == "bert":
            cfg = transformers.BertConfig()
            model = transformers.BertForMaskedLM(cfg)
        elif kind == "gpt2":
            cfg = transformers.GPT2Config()
            model = transformers.GPT2LMHeadModel(cfg)
        else:
            cfg = transformers.XLMRobertaConfig(vocab_size=250002, hidden_size=768,
                                                num_hidden_layers=12, num_attention_heads=12,
                                                intermediate_size=3072, max_position_embeddings=514,
                                                type_vocab_size=1)
            model = transformers.XLMRobertaForMaskedLM(cfg)
        cfg.use_cache = False
        ids = torch.randint(0, cfg.vocab_size, (batch_size, SEQ_LEN), device=device)
        ce = torch.nn.CrossEntropyLoss()

        def loss(out):
            logits = out.logits if hasattr(out, "logits") else out[0]
            return ce(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))

        return model, (ids,), loss
    raise ValueError(f"unknown model {name!r}: choose one of {', '.join(names())}, "
                     "or pass a saved graph (.json)")
