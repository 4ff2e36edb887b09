"""Models the planner CLI and benchmark know by name, with example inputs.

torchvision classification, video and ViT models are built untrained (the
ones named here, and any other torchvision image classifier by its name); the
transformers models (BERT-base, GPT-2, XLM-R-base) are built from their
default configurations, so nothing is downloaded. Two more spellings:

* ``hf:<model_type>[,key=value...]``: any transformers model by its
  configuration (``AutoConfig.for_model``), keys overriding the defaults,
  e.g. ``hf:llama,num_hidden_layers=2,hidden_size=256``;
* ``module:callable``: a user's own model; ``callable(batch_size)`` returns
  ``(model, example_inputs, loss_fn)`` with ``loss_fn(model(*inputs))`` the
  loss. The current directory is searched first.
"""
from __future__ import annotations

import ast
import importlib
import os
import sys

TORCHVISION = ("alexnet", "vgg16", "resnet18", "resnet50", "mobilenet_v2", "mnasnet1_0",
               "efficientnet_b0", "inception_v3", "vit_b_16", "r3d_18")
TRANSFORMERS = {"bert-base": "bert", "gpt2": "gpt2", "xlm-roberta-base": "xlmr"}
SEQ_LEN = 128


def names() -> list[str]:
    return list(TORCHVISION) + list(TRANSFORMERS)


def build(name: str, batch_size: int, device: str = "cpu", input_size: int | None = None):
    """Returns (model, example_inputs, loss_fn), with the model, inputs and
    targets on ``device``. ``input_size``: an image classifier's input side
    in pixels (default 224; CIFAR's is 32)."""
    check_input_size(name, input_size)
    try:
        model, inputs, loss = _build(name, batch_size, device, input_size or 224)
    except RuntimeError as e:
        if not _out_of_host_memory(e):
            raise
        raise ValueError(f"model {name!r} at batch {batch_size}: its example inputs need more "
                         "host memory than this machine has; give a smaller batch size") from None
    return model.to(device), inputs, loss


def check_input_size(name: str, input_size: int | None) -> None:
    """An input size is for torchvision's 2-D image classifiers, 16 to 4096 pixels."""
    if input_size is None:
        return
    if name in ("r3d_18", "inception_v3") or not (name in TORCHVISION
                                                  or _torchvision_classifier(name)):
        raise ValueError(f"an input size applies to torchvision's 2-D image classifiers, not "
                         f"{name!r}")
    if not 16 <= input_size <= 4096:
        raise ValueError(f"input size must be 16 to 4096 pixels, got {input_size}")


def is_known(name: str) -> bool:
    return (name in TORCHVISION or name in TRANSFORMERS or _torchvision_classifier(name)
            or name.startswith("hf:") or is_user_model(name))


def is_user_model(name: str) -> bool:
    """A model from the user's own module (``module:function``), not the library's."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr and all(p.isidentifier() for p in module.split("."))
                and attr.isidentifier())


def job_model(name: str, input_size: int | None = None, label: str | None = None):
    """The simulator's ``JobModel`` of ``build(name, ..., input_size=input_size)``,
    its captures kept in the capture cache where the model is a library's.
    ``label``: its name in reports; by default ``name``, or ``name-<side>px``
    at another input size (another model: the kernel tables measured at
    224x224 are not taken for it)."""
    from ..sim.jobs import JobModel

    if label is None:
        label = name if input_size is None else f"{name}-{input_size}px"
    return JobModel(label, lambda b: build(name, b, input_size=input_size),
                    cache_key=cache_key(name, input_size))


def cache_key(name: str, input_size: int | None = None) -> str | None:
    """What identifies ``build(name, ..., input_size=input_size)``'s model to
    the capture cache (``waterwave.sim.capture_cache``); None for a user's
    own model, whose module may change between runs."""
    return None if is_user_model(name) else f"{name}@{input_size or 224}px"


def _user_model(spec: str, batch_size: int):
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"model {spec!r}: cannot import {module_name!r} ({e}); run from the "
                         "directory that holds it or add it to PYTHONPATH") from None
    except Exception as e:  # the user's module: a syntax error, or raising as it loads
        raise ValueError(f"model {spec!r}: importing {module_name!r} failed: "
                         f"{type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"model {spec!r}: {module_name} has no callable {attr!r}")
    try:
        built = fn(batch_size)
    except SystemExit as e:  # not an answer: the command would end silently with its code
        raise ValueError(f"model {spec!r}: {attr}({batch_size}) called sys.exit({e.code!r}) "
                         "instead of returning (model, example_inputs, loss_fn)") from None
    except RuntimeError as e:
        if _out_of_host_memory(e):
            raise ValueError(f"model {spec!r}: {attr}({batch_size}) needs more host memory than "
                             "this machine has; give a smaller batch size") from None
        raise ValueError(f"model {spec!r}: {attr}({batch_size}) raised "
                         f"{type(e).__name__}: {e}") from None
    except Exception as e:  # the user's builder raised: say so in one line, with its error
        raise ValueError(f"model {spec!r}: {attr}({batch_size}) raised "
                         f"{type(e).__name__}: {e}") from None
    import torch

    shape = ("must return (model, example_inputs, loss_fn): a torch.nn.Module, a tensor or a "
             "tuple of tensors, and a function with loss_fn(model(*example_inputs)) the loss")
    if not (isinstance(built, (tuple, list)) and len(built) == 3):
        raise ValueError(f"model {spec!r}: {attr}(batch_size) {shape}; it returned "
                         f"{_describe(built)}")
    model, inputs, loss = built
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    for what, ok in (("model", isinstance(model, torch.nn.Module)),
                     ("example_inputs", all(isinstance(x, torch.Tensor) for x in inputs)),
                     ("loss_fn", callable(loss))):
        if not ok:
            got = _describe(model if what == "model" else built[1] if what == "example_inputs"
                            else loss)
            raise ValueError(f"model {spec!r}: {attr}(batch_size) {shape}; its {what} is {got}")
    return model, inputs, loss


def _out_of_host_memory(error: RuntimeError) -> bool:
    """PyTorch's CPU allocator says it ran out in a RuntimeError, not a MemoryError."""
    return "can't allocate memory" in str(error)


def _describe(value) -> str:
    """What a builder returned, by type: enough to see what to fix."""
    if not isinstance(value, (tuple, list)):
        name = type(value).__name__
        return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
    names = [type(v).__name__ for v in value[:4]] + (["..."] if len(value) > 4 else [])
    return f"a {type(value).__name__} of {len(value)}: ({', '.join(names)})"


def _hf_config(spec: str):
    """``hf:<model_type>[,key=value...]`` as a transformers configuration."""
    transformers = _transformers(spec)
    model_type, *pairs = spec[len("hf:"):].split(",")
    try:
        cfg = transformers.AutoConfig.for_model(model_type.strip())
    except ValueError:
        raise ValueError(f"model {spec!r}: transformers has no model type {model_type!r} "
                         "(see transformers.CONFIG_MAPPING)") from None
    for pair in pairs:
        key, eq, text = pair.partition("=")
        key = key.strip()
        if not eq or not hasattr(cfg, key):
            raise ValueError(f"model {spec!r}: {pair!r} is not key=value for a field of "
                             f"{type(cfg).__name__}")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            value = text.strip()
        default = getattr(cfg, key)
        if isinstance(default, (int, float)) and not isinstance(default, bool) and (
                isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"model {spec!r}: {key} must be a number (it is {default!r} by "
                             f"default), got {text.strip()!r}")
        try:
            setattr(cfg, key, value)
        except Exception as e:  # transformers validates some fields as they are set
            raise ValueError(f"model {spec!r}: {key}={text.strip()} is refused by "
                             f"{type(cfg).__name__} ({_one_line(e)})") from None
    return transformers, cfg


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _transformers(name: str):
    try:
        import transformers
    except ImportError:
        raise ValueError(f"model {name!r} needs the transformers package: "
                         "pip install 'transformers>=4.40'") from None
    return transformers


def main_output(out):
    """A classifier's main output: models that return auxiliary outputs in
    training (torchvision's GoogLeNet and Inception-v3 return named tuples
    whose first field is the logits) give their first."""
    return out[0] if isinstance(out, tuple) else out


def _torchvision_classifier(name: str) -> bool:
    """Any other torchvision image classifier, by its name (224x224 inputs)."""
    try:
        import torchvision
    except ImportError:
        return False
    return name in torchvision.models.list_models(module=torchvision.models)


def _build(name: str, batch_size: int, device: str, side: int = 224):
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
            # GoogLeNet's init_weights: torchvision's coming default (False), stated, so
            # that it neither warns that the default changes nor takes scipy's slow init.
            extra = {"init_weights": False} if name == "googlenet" else {}
            model = torchvision.models.get_model(name, **extra)
            x = torch.randn(batch_size, 3, side, side, device=device)
        target = torch.randint(0, 1000 if name != "r3d_18" else 400, (batch_size,), device=device)
        loss = torch.nn.CrossEntropyLoss()
        return model, (x,), lambda out: loss(main_output(out), target)
    if name.startswith("hf:"):
        transformers, cfg = _hf_config(name)
        model, refusals = None, []
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM):
            try:
                model = auto.from_config(cfg)
                break
            except Exception as e:  # not this kind of model, or values it cannot build
                if "Unrecognized configuration class" not in str(e):
                    refusals.append(f" ({type(e).__name__}: {_one_line(e)})")
        if model is None:
            raise ValueError(f"model {name!r}: transformers builds no causal or masked language "
                             f"model from this configuration{''.join(refusals[:1])}; check the "
                             "values given, or pass your own model as module:callable")
        return model, *_token_inputs(cfg, batch_size, device)
    if is_user_model(name):
        return _user_model(name, batch_size)
    if name in TRANSFORMERS:
        transformers = _transformers(name)
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
        return model, *_token_inputs(cfg, batch_size, device)
    raise ValueError(f"unknown model {name!r}: choose one of {', '.join(names())}, any "
                     "torchvision classifier, hf:<model_type>[,key=value...], module:callable, "
                     "or a saved graph (.json)")


def _token_inputs(cfg, batch_size: int, device: str):
    """Token ids of SEQ_LEN and a language-model loss over them."""
    import torch

    cfg.use_cache = False
    seq = min(SEQ_LEN, getattr(cfg, "max_position_embeddings", SEQ_LEN) or SEQ_LEN)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq), device=device)
    ce = torch.nn.CrossEntropyLoss()

    def loss(out):
        logits = out.logits if hasattr(out, "logits") else out[0]
        return ce(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))

    return (ids,), loss
