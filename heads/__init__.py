"""Draft heads: what a head *is* (config + module). See docs/design.md for the contracts."""
from draftsmith.heads.auto import HEAD_CLASSES, AutoHead, build_head
from draftsmith.heads.common import DraftHead, DraftHeadConfig, target_identity
from draftsmith.heads.dflash import DFlashConfig, DFlashHead
from draftsmith.heads.eagle import EagleConfig, EagleHead
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids
from draftsmith.heads.early_exit import EarlyExitConfig, EarlyExitHead
from draftsmith.heads.layers import HeadCache, HeadOutput
from draftsmith.heads.medusa import MedusaConfig, MedusaHead

__all__ = [
    "AutoHead",
    "build_head",
    "HEAD_CLASSES",
    "DraftHead",
    "DraftHeadConfig",
    "target_identity",
    "MedusaConfig",
    "MedusaHead",
    "EagleConfig",
    "EagleHead",
    "Eagle3Config",
    "Eagle3Head",
    "default_aux_layer_ids",
    "DFlashConfig",
    "DFlashHead",
    "EarlyExitConfig",
    "EarlyExitHead",
    "HeadCache",
    "HeadOutput",
]
