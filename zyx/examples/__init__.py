"""Runnable examples: ``python -m zyx.examples.train`` trains a convnet on handwritten digits."""
