"""Layer 4: dtype policy and loss scaling (overflow agreed across ranks)."""

from zerodist.precision.loss_scaler import LossScaler
from zerodist.precision.policy import PrecisionPolicy

__all__ = ["LossScaler", "PrecisionPolicy"]
