"""Hugging Face causal LMs as pipec layers (``pipec.torch.hf_layers``, ``pipec.torch.model_spec``).

A pipec transformer model is a list of layers: the embedding, each block, then the final norm
with the LM head. ``hf_layers(model)`` cuts a ``transformers`` causal LM (GPT-2, and the Llama
family: Llama, Mistral, and others built of the same decoder layers) into those layers, each an
``nn.Module`` that takes the previous one's output, so that
``pipec.torch.stage_modules(plan, hf_layers(model))`` gives the plan's stages:

- every block is given an explicit causal mask, so it is causal whatever the model's attention
  implementation (eager, SDPA: a block called without a mask attends both ways under eager);
- rotary positions (Llama's, computed once per model by transformers) are recomputed inside
  each block from the model's own rotary module, so every stage has them;
- tied input and output embeddings get two parameters of equal value, the embedding's and the
  head's, marked as one tied pair: ``PipelineRunner`` sums their gradients after each step and
  keeps them equal, on one rank or two (V-shaped schedules put both on rank 0), instead of
  letting PyTorch scale a shared parameter once per stage.

The layers share the model's parameters (no copy), except the head's tied copy.
``model_spec(config)`` is the pipemodel/1 spec of the same model, from the same rules as
``pipec spec --from-hf``.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

import pipec

__all__ = ["hf_layers", "model_spec", "tied_pairs"]

#: Attribute set on the two parameters of a tied embedding: "embedding" or "head".
TIED = "_pipec_tied"


def model_spec(config, *, seq_length: int | None = None, microbatch_size: int = 1,
               name: str | None = None) -> dict:
    """The pipemodel/1 spec (a dict) of a Hugging Face config (a ``PretrainedConfig``, a dict,
    or the path of a config.json), as ``pipec spec --from-hf``: the sequence defaults to the
    config's context. Raises ValueError naming the config field pipec cannot run."""
    path = None
    if isinstance(config, dict):
        text, source = json.dumps(config), "config"
    elif hasattr(config, "to_json_string"):
        text, source = config.to_json_string(use_diff=False), "config"
    elif isinstance(config, (str, os.PathLike)):
        path = pipec._path("config", config)
    else:
        raise TypeError(f"config: expected a transformers config, a dict or a path "
                        f"(got {type(config).__name__})")
    # The bounds of `pipec spec`'s own flags.
    table = pipec._table("spec")
    for flag, value in (("seq_length", seq_length), ("microbatch_size", microbatch_size)):
        if value is None and flag == "seq_length":
            continue
        most = table[flag]["max"]
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
            raise ValueError(f"{flag}: expected an integer in [1, {most}] (got {value!r})")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name: expected a str (got {type(name).__name__})")
    name = pipec._text(table["name"], name or "")
    if path is not None:
        spec = pipec._pipec.spec_from_hf_file(path, name, seq_length or 0, microbatch_size)
    else:
        spec = pipec._pipec.spec_from_hf(text, source, name, seq_length or 0, microbatch_size)
    return json.loads(spec)


def _causal_mask(hidden: torch.Tensor) -> torch.Tensor:
    """An additive (1, 1, T, T) mask: 0 on and below the diagonal, the dtype's minimum above."""
    t = hidden.shape[1]
    allowed = torch.ones(t, t, dtype=torch.bool, device=hidden.device).tril()
    mask = torch.zeros(t, t, dtype=hidden.dtype, device=hidden.device)
    return mask.masked_fill(~allowed, torch.finfo(hidden.dtype).min)[None, None]


class _Gpt2Embedding(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions)[None])


class _TokenEmbedding(nn.Module):
    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.embed = embed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)


class _Block(nn.Module):
    """One decoder layer with its causal mask and, with a rotary module, its positions."""

    def __init__(self, layer: nn.Module, rotary: nn.Module | None):
        super().__init__()
        self.layer = layer
        # Not a submodule: its buffers belong to the model, and it has no parameters.
        self._rotary = [rotary] if rotary is not None else []

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kwargs = {"attention_mask": _causal_mask(hidden)}
        if self._rotary:
            positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
            kwargs["position_ids"] = positions
            kwargs["position_embeddings"] = self._rotary[0](hidden, positions)
        out = self.layer(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def _untie(embedding: nn.Parameter, lm_head: nn.Linear) -> None:
    """Give the head its own parameter equal to the embedding's, and mark the pair."""
    if lm_head.weight is embedding:
        lm_head.weight = nn.Parameter(embedding.detach().clone())
    setattr(embedding, TIED, "embedding")
    setattr(lm_head.weight, TIED, "head")


def hf_layers(model: nn.Module) -> list[nn.Module]:
    """The pipec layers of a transformers causal LM: [embedding, block 0, ..., block L-1,
    final norm + head], as ``pipec.torch.stage_modules`` takes them. GPT2LMHeadModel and
    the Llama family (``model.model.layers``, ``embed_tokens``, ``norm``, ``rotary_emb``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a transformers causal LM (got {type(model).__name__})")
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    kind = getattr(config, "model_type", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if kind == "gpt2" and hasattr(model, "transformer"):
        body = model.transformer
        if tied:
            _untie(body.wte.weight, lm_head)
        return ([_Gpt2Embedding(body.wte, body.wpe, body.drop)] +
                [_Block(block, None) for block in body.h] + [_Head(body.ln_f, lm_head)])
    body = getattr(model, "model", None)
    if lm_head is not None and all(hasattr(body, a) for a in
                                   ("embed_tokens", "layers", "norm", "rotary_emb")):
        if tied:
            _untie(body.embed_tokens.weight, lm_head)
        return ([_TokenEmbedding(body.embed_tokens)] +
                [_Block(layer, body.rotary_emb) for layer in body.layers] +
                [_Head(body.norm, lm_head)])
    raise ValueError(f"model: a {type(model).__name__} (model_type {kind!r}) is not a GPT-2 or "
                     "Llama-family causal LM (lm_head with transformer.h, or model.layers with "
                     "embed_tokens, norm and rotary_emb)")


def tied_pairs(modules) -> dict:
    """The tied-embedding parameters among `modules`: {"embedding": p, "head": q}, each present
    only where one of the modules holds it."""
    found = {}
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            role = getattr(p, TIED, None)
            if role is not None:
                found[role] = p
    return found
