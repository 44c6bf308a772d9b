"""zyx.utils: helpers with torch.utils' names (the data pipeline lives in zyx.utils.data)."""
from . import data

__all__ = ["data"]
