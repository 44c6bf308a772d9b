"""``python -m zyx.examples`` runs the training demo (same as ``python -m zyx.examples.train``)."""
from .train import main

main()
