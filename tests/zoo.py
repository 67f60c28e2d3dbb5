"""Models we did not write, each called the way its users call it: tiny random-init configs of real Hugging Face
classes (nothing is downloaded), LoRA through PEFT, a torchvision-style ResNet with BatchNorm, an LSTM language
model, and models that checkpoint themselves.

Each builder returns a :class:`Family`: the model in train mode, its batch as its users pass it (a keyword batch
with an attention mask holding a padded row for the language models, config defaults such as ``use_cache`` left
alone), the loss, and how the optimizer is built. Sizes keep a CPU step well under a second while activations,
not weights, set the peak.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class Family:
    name: str
    model: nn.Module
    batch: tuple[Any, ...] | dict[str, Any]
    loss_fn: Callable[[Any], torch.Tensor] | None = None  # None: the model's own loss (Hugging Face, labels given)
    lr: float = 1e-3

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr)


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    # transformers 5 renamed gradient checkpointing to activation checkpointing; users still call the old names,
    # and so do PEFT's wrappers.
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated", category=FutureWarning)


def lm_batch(vocab: int, batch: int = 4, seq: int = 128, pad_from: int = 96) -> dict[str, torch.Tensor]:
    """Token ids, an attention mask whose second row is padded from ``pad_from`` on, and labels ignoring pads."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, pad_from:] = 0
    ids[1, pad_from:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def seq2seq_batch(vocab: int) -> dict[str, torch.Tensor]:
    """An encoder batch of 4 x 96 (:func:`lm_batch`, a row padded from 64) and decoder labels of 4 x 64."""
    batch = lm_batch(vocab, seq=96, pad_from=64)
    batch["labels"] = torch.randint(3, vocab, (4, 64), generator=torch.Generator().manual_seed(1))
    return batch


def gpt2() -> Family:
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
    return Family("gpt2", GPT2LMHeadModel(config).train(), lm_batch(128))


def _llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def llama() -> Family:
    from transformers import LlamaForCausalLM

    _quiet_transformers()
    torch.manual_seed(0)
    return Family("llama", LlamaForCausalLM(_llama_config()).train(), lm_batch(128))


def llama_lora() -> Family:
    """LoRA adapters on the attention projections of a Llama decoder: only they train."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    _quiet_transformers()
    torch.manual_seed(0)
    base = LlamaForCausalLM(_llama_config())
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    return Family("llama_lora", get_peft_model(base, lora).train(), lm_batch(128))


def bert() -> Family:
    """A BERT sequence classifier with attention and hidden dropout."""
    from transformers import BertConfig, BertForSequenceClassification

    _quiet_transformers()
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        num_labels=3,
        attention_probs_dropout_prob=0.1,
        hidden_dropout_prob=0.1,
        pad_token_id=0,
    )
    batch = lm_batch(128)
    batch["labels"] = torch.tensor([0, 2, 1, 1])
    return Family("bert", BertForSequenceClassification(config).train(), batch)


def t5() -> Family:
    """An encoder-decoder: labels shifted into decoder inputs by the model, a padded target row."""
    from transformers import T5Config, T5ForConditionalGeneration

    _quiet_transformers()
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=128,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    batch = seq2seq_batch(128)
    batch["labels"][2, 48:] = -100
    return Family("t5", T5ForConditionalGeneration(config).train(), batch)


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: conv-BN-ReLU(in place), conv-BN, residual add in place, ReLU in place."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """A two-stage torchvision-style ResNet for 32x32 images."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet() -> Family:
    torch.manual_seed(0)
    images = torch.randn(16, 3, 32, 32)
    labels = torch.randint(0, 10, (16,))
    return Family("resnet", ResNet().train(), (images,), lambda out: F.cross_entropy(out, labels))


class LSTMLM(nn.Module):
    """Embedding, a two-layer LSTM with dropout between layers, a linear head."""

    def __init__(self, vocab: int = 1024, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, 2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids))
        return self.head(hidden)


def lstm() -> Family:
    torch.manual_seed(0)
    ids = torch.randint(0, 1024, (8, 64))
    targets = torch.randint(0, 1024, (8, 64))
    return Family("lstm", LSTMLM().train(), (ids,), lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten()))


class Block(nn.Module):
    """A pre-norm MLP block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class SelfCheckpointing(nn.Module):
    """A model that checkpoints its first blocks itself, with ``torch.utils.checkpoint`` in its forward."""

    def __init__(self, d: int = 64, depth: int = 4, checkpointed: int = 2, reentrant: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 16)
        self.checkpointed = checkpointed
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=self.reentrant) if i < self.checkpointed else block(x)
        return self.head(x)


def self_checkpointing(reentrant: bool = False) -> Family:
    torch.manual_seed(0)
    x = torch.randn(32, 64, 64)
    model = SelfCheckpointing(reentrant=reentrant).train()
    return Family("self_checkpointing", model, (x,), lambda out: out.float().square().mean())


def gpt2_gradient_checkpointing() -> Family:
    """GPT-2 with Hugging Face's own gradient checkpointing on every layer."""
    family = gpt2()
    family.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    family.name = "gpt2_gradient_checkpointing"
    return family


def _moe_sizes() -> dict[str, Any]:
    # 4 experts, 2 per token: 512 tokens send 1024 rows through each layer's experts, 256 per expert on the dry
    # run's even split; the real step's random routers give 147 to 346 (tests/test_moe.py).
    return {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 128,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def mixtral_grouped_mm(router_jitter_noise: float = 0.0) -> Family:
    """A Mixtral mixture of experts with transformers' default experts: one grouped matmul for all experts.

    ``router_jitter_noise``: the sparse block multiplies its input in place by noise of this width in training.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    _quiet_transformers()
    torch.manual_seed(0)
    config = MixtralConfig(**_moe_sizes(), num_local_experts=4, router_jitter_noise=router_jitter_noise)
    return Family("mixtral_grouped_mm", MixtralForCausalLM(config).train(), lm_batch(128))


def olmoe_eager() -> Family:
    """An OLMoE mixture of experts with the eager experts: a loop over the experts the routing hits."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    _quiet_transformers()
    torch.manual_seed(0)
    config = OlmoeConfig(**_moe_sizes(), num_experts=4, experts_implementation="eager")
    return Family("olmoe_eager", OlmoeForCausalLM(config).train(), lm_batch(128))


def wav2vec2_ctc(layerdrop: float = 0.0) -> Family:
    """A CTC speech recognizer: its loss's output shape depends on the label lengths (varied here), batch values.

    ``layerdrop``: the share of steps each layer is skipped in (Hugging Face's default is 0.1).
    """
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    _quiet_transformers()
    torch.manual_seed(0)
    config = Wav2Vec2Config(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(32, 32, 32),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        pad_token_id=0,
        ctc_loss_reduction="mean",
        # SpecAugment draws its masks from numpy's random stream: off, so that the planned and the plain runs
        # compute the same step. LayerDrop draws from torch's, which both runs start from the same seed.
        mask_time_prob=0.0,
        layerdrop=layerdrop,
    )
    g = torch.Generator().manual_seed(1)
    audio = torch.randn(4, 8000, generator=g)
    labels = torch.randint(1, 32, (4, 30), generator=g)
    labels[1, 20:] = -100
    labels[2, 12:] = -100
    return Family("wav2vec2_ctc", Wav2Vec2ForCTC(config).train(), {"input_values": audio, "labels": labels})


def detr() -> Family:
    """A DETR detector: its loss matches predictions to targets with scipy's ``linear_sum_assignment`` on the host.

    Labels are a list of per-image dicts of class labels and boxes (center format), with varied box counts.
    """
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig

    _quiet_transformers()
    torch.manual_seed(0)
    backbone = ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        out_features=["stage2"],
    )
    config = DetrConfig(
        use_timm_backbone=False,
        backbone_config=backbone,
        use_pretrained_backbone=False,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_queries=16,
        num_labels=5,
    )
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(2, 3, 128, 128, generator=g)
    labels = [
        {"class_labels": torch.tensor([1, 3, 4]), "boxes": torch.rand(3, 4, generator=g) * 0.5 + 0.25},
        {"class_labels": torch.tensor([2]), "boxes": torch.rand(1, 4, generator=g) * 0.5 + 0.25},
    ]
    return Family("detr", DetrForObjectDetection(config).train(), {"pixel_values": pixels, "labels": labels})


def rwkv() -> Family:
    """A recurrent LM: RWKV's CPU path scans the sequence and fills its output by slice writes,
    ``output = torch.zeros_like(key)`` then ``output[:, t] = ...`` per token; blocks take ``state=`` by keyword."""
    from transformers import RwkvConfig, RwkvForCausalLM

    _quiet_transformers()
    torch.manual_seed(0)
    config = RwkvConfig(
        vocab_size=128, context_length=64, hidden_size=64, num_hidden_layers=2, intermediate_size=256, rescale_every=0
    )
    batch = lm_batch(128, batch=8, seq=48, pad_from=40)
    del batch["attention_mask"]  # RWKV has no attention mask; the padded row's labels are ignored
    return Family("rwkv", RwkvForCausalLM(config).train(), batch)


FAMILIES: dict[str, Callable[[], Family]] = {
    f.__name__: f
    for f in (gpt2, llama, llama_lora, bert, t5, resnet, lstm, self_checkpointing, gpt2_gradient_checkpointing)
}
FAMILIES["wav2vec2_ctc"] = wav2vec2_ctc
FAMILIES["mixtral_grouped_mm"] = mixtral_grouped_mm
FAMILIES["olmoe_eager"] = olmoe_eager
FAMILIES["detr"] = detr
FAMILIES["rwkv"] = rwkv


def beit() -> Family:
    """A BEiT image classifier with relative position bias: an index its code computes once per window size and
    keeps in an LRU cache (``generate_relative_position_index``), stochastic depth and dropout."""
    from transformers import BeitConfig, BeitForImageClassification

    _quiet_transformers()
    torch.manual_seed(0)
    config = BeitConfig(
        image_size=64,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        use_relative_position_bias=True,
        drop_path_rate=0.1,
        hidden_dropout_prob=0.1,
        use_mean_pooling=True,
        num_labels=10,
    )
    g = torch.Generator().manual_seed(1)
    pixels, labels = torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, 10, (4,), generator=g)
    return Family("beit", BeitForImageClassification(config).train(), {"pixel_values": pixels, "labels": labels})


def led() -> Family:
    """A Longformer encoder-decoder: sliding-window attention with global attention on each row's first token."""
    from transformers import LEDConfig, LEDForConditionalGeneration

    _quiet_transformers()
    torch.manual_seed(0)
    config = LEDConfig(
        vocab_size=128,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_encoder_position_embeddings=128,
        max_decoder_position_embeddings=128,
        attention_window=32,
        dropout=0.1,
        attention_dropout=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    batch = seq2seq_batch(128)
    batch["global_attention_mask"] = torch.zeros_like(batch["attention_mask"])
    batch["global_attention_mask"][:, 0] = 1
    return Family("led", LEDForConditionalGeneration(config).train(), batch)
