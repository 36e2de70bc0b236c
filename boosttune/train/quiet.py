"""Known-harmless output of Lightning during a stage, silenced one message at a time.

Each entry names the message and why it says nothing to a user of `boosttune train`; everything else
Lightning, torch or boosttune prints (warnings included) still shows. Never a blanket filter.
"""

from __future__ import annotations

import logging
import warnings

# Lightning's rank-zero info lines go through these loggers (lightning_utilities' module logger is
# replaced by one of them, whichever of lightning.pytorch and lightning.fabric was imported last).
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")

DROPPED_INFO = (
    "💡 Tip:",  # advertisements for Lightning's cloud services (litlogger, litmodels), one per Trainer
    "`Trainer.fit` stopped: `max_steps=",  # the expected end of every stage; the stage's own line follows
)
"""Prefixes of Lightning's rank-zero info lines that are dropped."""


class DropLightningInfo(logging.Filter):
    """Drops the log records whose message starts with one of :data:`DROPPED_INFO`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(DROPPED_INFO)


def quiet_lightning() -> None:
    """Install the filters (idempotent): call before a Trainer is made."""
    # Lightning's utilities/_pytree.py (2.6 here) builds torch pytree LeafSpecs, which torch (2.13 here)
    # deprecates with a FutureWarning at every fit: Lightning's code, not ours, and harmless.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropLightningInfo) for f in logger.filters):
            logger.addFilter(DropLightningInfo())
