"""Version 0 without a download (`islands.build_version0`): the run's first parameters
as an island has them, built from the run's seed or read from the warm start's file on
its node's storage, and their SHA-256, which the coordinator compares with its own
before it tells the island to start from them."""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..wire.handoff import params_sha256
from .island_spec import IslandSpec

log = logging.getLogger(__name__)


def version0(spec: IslandSpec, params: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """The first parameters this island can start from without a download, and their
    hash; (None, "unreadable") when the warm start's file cannot be read here."""
    if spec.version0_file is None:
        built = params.detach().clone()
    else:
        try:
            built = torch.from_numpy(np.load(spec.version0_file)).to(params.device, params.dtype)
        except (OSError, ValueError) as err:  # not on this node's storage: it downloads them
            log.warning(
                "island %d cannot read %s (%s): it downloads the first parameters", spec.index, spec.version0_file, err
            )
            return None, "unreadable"
    return built, params_sha256(built.cpu().numpy())
