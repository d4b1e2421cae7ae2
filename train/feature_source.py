"""Where a training batch's target hidden states come from (issue 19): the target's forward (online),
a folder written by ``scripts/dump_features.py`` (``data.features``: offline), or a folder filled
during the first epoch and read after it (``data.feature_cache``: hybrid).

Either way the head's ``Features`` are built by the same ``Objective.from_states`` from the final
(and aux) hidden states, so stored float32 states give the online run's losses. The target is still
loaded: its embedding table, lm_head and final norm rebuild the rest, EAGLE-3 starts from it, and
held-out evaluation runs it online.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging

import torch
from torch import nn

from draftsmith.data.feature_store import FeatureStore, FeatureStoreError, open_store
from draftsmith.data.pipeline import tokenizer_fingerprint
from draftsmith.target.model import TargetOutput, causal_lm_of, loaded_target_identity, target_forward
from draftsmith.train.config import TrainConfig
from draftsmith.train.features import Features

logger = logging.getLogger("draftsmith.train")


def weights_digest(target: nn.Module) -> str:
    """sha256 (16 hex) of a strided sample of the target's embedding and lm_head rows and its final
    norm: tells a retrained target under the same name apart without hashing all its weights."""
    model = causal_lm_of(target)
    h = hashlib.sha256()
    for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        step = max(1, weight.shape[0] // 256)
        h.update(weight.detach()[::step].float().cpu().numpy().tobytes())
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") and ".layers." not in name:  # the final norm
            h.update(param.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def feature_fingerprint(cfg: TrainConfig, target: nn.Module, tokenizer, aux_layer_ids, rows: int) -> dict:
    """What stored states depend on; a folder made for other values is refused naming the key."""
    identity = loaded_target_identity(target)
    return {
        "target": identity["name_or_path"], "target.architecture": identity["architecture"],
        "target.hidden_size": identity["hidden_size"], "target.num_layers": identity["num_layers"],
        "target.vocab_size": identity["vocab_size"], "target.weights": weights_digest(target),
        "target.dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "head.kind": cfg.head.kind, "aux_layer_ids": list(aux_layer_ids),
        "data.train": cfg.data.train, "data.max_length": cfg.data.max_length, "data.overlong": cfg.data.overlong,
        "data.lenient_json": cfg.data.lenient_json, "data.rows": rows, "tokenizer": tokenizer_fingerprint(tokenizer),
        **({"data.self_distill": dataclasses.asdict(cfg.data.self_distill)} if cfg.data.self_distill.rows else {}),
    }


def row_states(out: TargetOutput, index: int, length: int) -> dict:
    """One row's unpadded states {"final": (T, H)[, "aux": (T, k·H)]} from a batch forward."""
    states = {"final": out.final_hidden[index, :length]}
    if out.aux_hidden is not None:
        states["aux"] = out.aux_hidden[index, :length]
    return states


class FeatureSource:
    """Hidden states per batch: online (``store`` None), read from ``store``, or (``fill``) read when
    every row of the batch is stored and else computed online and added."""

    def __init__(self, store: FeatureStore | None = None, fill: bool = False, key: str = "") -> None:
        self.store, self.fill, self.key = store, fill, key
        self.read_batches = self.online_batches = 0

    @classmethod
    def for_run(cls, accelerator, cfg: TrainConfig, target: nn.Module, tokenizer, aux_layer_ids,
                rows: int) -> FeatureSource:
        """The source ``cfg`` asks for (``data.features`` / ``data.feature_cache`` / neither)."""
        path, key = (cfg.data.features, "data.features") if cfg.data.features else \
            (cfg.data.feature_cache, "data.feature_cache")
        if path is None:
            return cls()
        fingerprint = feature_fingerprint(cfg, target, tokenizer, aux_layer_ids, rows)
        if key == "data.features":
            store = open_store(path, fingerprint, key=key)
            if len(store) != rows:
                raise FeatureStoreError(f"data.features={path} holds {len(store)} of data.train's {rows} rows: "
                                        "finish the dump (run scripts/dump_features.py again with the same --out)")
            logger.info("training from stored features %s (%d rows, %s): the target's forward is skipped",
                        path, rows, store.dtype)
            return cls(store, key=key)
        dtype = fingerprint["target.dtype"]  # lossless: the target's own precision
        with accelerator.main_process_first():  # the first process makes the folder ours
            store = open_store(path, fingerprint, key=key, dtype=dtype, create=accelerator.is_main_process,
                               writer=f"rank{accelerator.process_index}")
        logger.info("feature cache %s: %d of %d rows stored; the rest are computed online and added", path,
                    len(store), rows)
        return cls(store, fill=True, key=key)

    def features(self, objective_cls, target: nn.Module, batch: dict, head: nn.Module) -> Features:
        """This batch's ``Features`` (``batch["rows"]``: the training-set rows it holds)."""
        if self.store is None:
            return objective_cls.features(target, batch, head)
        rows = batch["rows"].tolist()  # note: a host-device sync, once per micro-batch
        if self.fill and not self.store.has(rows):
            if self.store.pending.intersection(rows):  # added earlier, not yet in a shard: write them first
                self.store.flush()
            self.store.refresh()  # other processes' shards
        if self.store.has(rows) or not self.fill:
            self.read_batches += 1
            return objective_cls.features(target, batch, head, states=self._stored(batch, rows))
        self.online_batches += 1
        with torch.no_grad():
            out = target_forward(target, batch["input_ids"], aux_layer_ids=objective_cls.aux_layer_ids(head),
                                 compute_logits=False)
        for i, (row, length) in enumerate(zip(rows, batch["lengths"].tolist())):
            if row not in self.store.pending and row not in self.store.index:  # stored once (a batch may
                # mix stored rows with new ones, or repeat one: accelerate pads the last batch with early rows)
                self.store.add(row, batch["input_ids"][i, :length], batch["loss_mask"][i, :length],
                               row_states(out, i, length))
        return objective_cls.features(target, batch, head, states=out)

    def close(self) -> None:
        """Write what is still buffered (a hybrid run's last rows)."""
        if self.fill:
            self.store.flush()

    def _stored(self, batch: dict, rows: list[int]) -> TargetOutput:
        """The batch's stored states padded to (B, T, D) with zeros (padding carries no loss)."""
        ids = batch["input_ids"]
        items = self.store.read(rows)
        batch_size, seq_len = ids.shape
        padded = {}
        for name in items[0]:
            if name in ("input_ids", "loss_mask"):
                continue
            padded[name] = torch.zeros(batch_size, seq_len, items[0][name].shape[-1], device=ids.device)
        for i, (row, item) in enumerate(zip(rows, items)):
            length = len(item["input_ids"])
            if not torch.equal(item["input_ids"].to(ids.device), ids[i, :length].long()) \
                    or length != int(batch["lengths"][i]):
                raise FeatureStoreError(f"{self.key}={self.store.path}: row {row} holds other tokens than data.train's "
                                        f"row {row}: the data changed since the features were stored; store them "
                                        "again in a new folder")
            for name in padded:
                padded[name][i, :length] = item[name].to(ids.device)
        return TargetOutput(logits=None, final_hidden=padded["final"], aux_hidden=padded.get("aux"),
                            past_key_values=None)
