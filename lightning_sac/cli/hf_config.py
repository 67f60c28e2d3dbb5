"""``lightning-sac plan --hf-config``: a Hugging Face causal LM planned from its ``config.json``, before weights exist.

The model is built on the meta device from the local config (nothing is downloaded, no weight is allocated), with
LoRA adapters through ``peft`` for ``--lora``, and planned for a causal-LM step on a batch of ``--batch`` rows of
``--seq`` tokens: ``input_ids``, ``attention_mask`` (all ones) and ``labels``; the loss is the model's own
``output.loss``. transformers and peft are imported only here, when the flag is used: a machine without them gets a
one-line error saying what to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_sac.cli.args import Made, UsageError, closest

__all__ = ["HfModel", "LoraSpec", "add_hf_arguments", "build_causal_lm", "causal_lm_batch", "check_hf_args"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LORA_KEYS = ("r", "targets", "alpha")
_LORA_EXAMPLE = "--lora r=16,targets=q_proj,v_proj[,alpha=32]"
_ONLY_WITH_CONFIG = ("batch", "seq", "lora", "dtype")


@dataclass(frozen=True)
class LoraSpec:
    """``--lora``: the adapters' rank, the modules they wrap and their scaling.

    ``targets`` ``None`` takes peft's default modules for the architecture, ``alpha`` ``None`` peft's default.
    """

    r: int
    targets: tuple[str, ...] | None = None
    alpha: int | None = None

    def describe(self) -> str:
        """``LoRA r=16 on q_proj, v_proj``."""
        on = ", ".join(self.targets) if self.targets else "peft's default modules"
        return f"LoRA r={self.r}" + (f" alpha={self.alpha}" if self.alpha is not None else "") + f" on {on}"


@dataclass(frozen=True)
class HfModel:
    """What ``--hf-config`` and its flags ask for.

    Attributes:
        config: The ``config.json`` file, or the folder holding it.
        batch: Rows of the batch.
        seq: Tokens per row.
        dtype: The parameters' dtype (a key of ``float32``, ``bfloat16``, ``float16``), or ``None``: the config's
            ``dtype`` (``torch_dtype``), as ``AutoModelForCausalLM.from_config`` takes it; float32 when it names none.
        lora: The adapters, or ``None`` for full fine-tuning.
    """

    config: Path
    batch: int
    seq: int
    dtype: str | None = None
    lora: LoraSpec | None = None


def add_hf_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--hf-config`` and the flags that go with it to ``plan``'s parser."""
    parser.add_argument(
        "--hf-config",
        default=None,
        help="plan a Hugging Face causal LM from its local config.json (or its folder) instead of a factory: built "
        "on the meta device, no weights read or downloaded; needs --batch and --seq",
    )
    parser.add_argument("--batch", type=int, default=None, help="with --hf-config: rows per batch")
    parser.add_argument("--seq", type=int, default=None, help="with --hf-config: tokens per row")
    parser.add_argument(
        "--dtype",
        choices=list(_DTYPES),
        default=None,
        help="with --hf-config: the parameters' dtype; default the config's dtype (float32 when it names none)",
    )
    parser.add_argument(
        "--lora",
        default=None,
        help="with --hf-config: LoRA adapters through peft, only they train: r=RANK[,targets=NAME,NAME...][,alpha=N]",
    )


def _positive(key: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"--lora {key}= takes a whole number above 0, got {value!r}: e.g. {_LORA_EXAMPLE}")
    return int(value)


def parse_lora(text: str) -> LoraSpec:
    """``r=16,targets=q_proj,v_proj,alpha=32`` as a :class:`LoraSpec`: a part without ``=`` is one more target.

    Raises:
        UsageError: No ``r``, an unknown key, or a value that is not a number above 0.
    """
    fields: dict[str, list[str]] = {}
    key = None
    for part in (p.strip() for p in text.split(",")):
        name, sep, value = part.partition("=")
        if sep:
            key = name.strip().lower()
            if key not in _LORA_KEYS:
                guess = closest(key, _LORA_KEYS)
                hint = f"did you mean {guess}=? " if guess else ""
                raise UsageError(f"--lora has no {key}=: {hint}it takes {', '.join(_LORA_KEYS)}, e.g. {_LORA_EXAMPLE}")
            fields[key] = [value.strip()]
        elif key == "targets" and part:
            fields[key].append(part)
        elif part:
            raise UsageError(f"--lora {text!r}: {part!r} has no KEY= before it; type e.g. {_LORA_EXAMPLE}")
    if "r" not in fields:
        raise UsageError(f"--lora {text!r} gives no rank: type e.g. {_LORA_EXAMPLE}")
    targets = tuple(t for t in fields.get("targets", []) if t) or None
    alpha = _positive("alpha", fields["alpha"][0]) if "alpha" in fields else None
    return LoraSpec(_positive("r", fields["r"][0]), targets, alpha)


def _require(module: str, flag: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{flag} builds the model with {module}, which is not installed: pip install {module}")


def check_hf_args(args: argparse.Namespace) -> HfModel | None:
    """``--hf-config``'s request, checked before anything is built; ``None`` when the flag is not given.

    Raises:
        UsageError: ``--batch``, ``--seq``, ``--dtype`` or ``--lora`` without ``--hf-config``; no config file;
            a batch or sequence length missing or below 1; a wrong ``--lora``; transformers (or peft) missing.
    """
    if args.hf_config is None:
        given = [f"--{name}" for name in _ONLY_WITH_CONFIG if getattr(args, name) is not None]
        if given:
            raise UsageError(
                f"{' '.join(given)} describe(s) the model of --hf-config, which is not given: add --hf-config "
                "path/to/config.json, or leave them out (a factory's batch is the one it returns)"
            )
        return None
    path = Path(args.hf_config)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        where = f"the folder {args.hf_config} holds no config.json" if path.is_dir() else f"no file {args.hf_config!r}"
        raise UsageError(f"--hf-config: {where} (from {Path.cwd()}): give the model's config.json or its folder")
    for flag in ("batch", "seq"):
        value = getattr(args, flag)
        if value is None or value < 1:
            got = "nothing" if value is None else str(value)
            raise UsageError(
                f"--hf-config needs --{flag}, a whole number above 0, got {got}: e.g. --batch 8 --seq 4096"
            )
    _require("transformers", "--hf-config")
    lora = None
    if args.lora is not None:
        lora = parse_lora(args.lora)
        _require("peft", "--lora")
    return HfModel(config, args.batch, args.seq, args.dtype, lora)


def _config(spec: HfModel) -> Any:
    from transformers import AutoConfig

    try:
        # A local file only: nothing is looked up on the Hub.
        return AutoConfig.from_pretrained(str(spec.config), local_files_only=True)
    except (ValueError, OSError, KeyError) as err:
        raise UsageError(
            f"--hf-config {spec.config} is not a config transformers reads ({' '.join(str(err).split())[:200]}): "
            "give a model's config.json, with its model_type"
        ) from None


def _from_config(config: Any, kwargs: dict[str, Any]) -> nn.Module:
    """``AutoModelForCausalLM.from_config``; for a config it maps to no causal LM, the class ``architectures`` names."""
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError:
        named = [
            getattr(transformers, n) for n in getattr(config, "architectures", None) or [] if hasattr(transformers, n)
        ]
        if named:
            # What from_config calls on the class it maps to: the config's dtype unless one is given.
            return named[0]._from_config(config, **kwargs)
        raise UsageError(
            f"--hf-config: transformers {transformers.__version__} has no causal LM for model_type "
            f"{config.model_type!r} (architectures: {getattr(config, 'architectures', None)}); plan it with a "
            "factory instead: lightning-sac plan mymodule:make"
        ) from None


def _vocab_size(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def build_causal_lm(spec: HfModel) -> tuple[nn.Module, str]:
    """The model, on the meta device and in train mode, and a line describing it for the plan's header.

    Raises:
        UsageError: The config cannot be read, or names no causal LM.
    """
    config = _config(spec)
    kwargs = {} if spec.dtype is None else {"dtype": _DTYPES[spec.dtype]}
    with torch.device("meta"):
        model = _from_config(config, kwargs)
        name = type(model).__name__
        if spec.lora is not None:
            from peft import LoraConfig, get_peft_model

            lora_kwargs: dict[str, Any] = {"r": spec.lora.r}
            if spec.lora.targets is not None:
                lora_kwargs["target_modules"] = list(spec.lora.targets)
            if spec.lora.alpha is not None:
                lora_kwargs["lora_alpha"] = spec.lora.alpha
            with warnings.catch_warnings():
                # peft asks transformers 5 for its renamed checkpointing flag by the old name: not the user's concern.
                warnings.filterwarnings(
                    "ignore", message=".*gradient_checkpointing.*deprecated", category=FutureWarning
                )
                model = get_peft_model(model, LoraConfig(**lora_kwargs))
    model.train()
    params = list(model.parameters())
    total, trained = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    dtypes = ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in params}))
    lora = f", {spec.lora.describe()}: {trained:,} of them train" if spec.lora is not None else ""
    return model, (
        f"model: {name} from {spec.config} on the meta device, {total:,} parameters ({dtypes}){lora}; "
        f"batch {spec.batch} x {spec.seq} tokens (input_ids, attention_mask, labels)"
    )


def causal_lm_batch(batch: int, seq: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """A causal-LM batch: token ids (seeded, so each run plans the same), an all-ones mask, the ids as labels."""
    ids = torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def hf_made(spec: HfModel) -> tuple[Made, str]:
    """The model and batch of ``--hf-config`` as a factory would return them, and the header's line about them.

    The loss is left to the step (:mod:`lightning_sac.cli.step`): the model's ``output.loss``, as labels are given.
    """
    model, about = build_causal_lm(spec)
    return Made(model, causal_lm_batch(spec.batch, spec.seq, _vocab_size(model.config))), about
