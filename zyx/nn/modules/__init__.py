"""The layers of zyx.nn, one file per family (as torch.nn.modules)."""
from .module import Module, Parameter
from .container import Sequential, ModuleList, ModuleDict
from .linear import (Identity, Linear, Bilinear, Flatten, Unflatten, PixelShuffle,
                     PixelUnshuffle)
from .conv import Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from .pooling import (MaxPool1d, MaxPool2d, MaxPool3d, AvgPool1d, AvgPool2d, AvgPool3d,
                      AdaptiveAvgPool1d, AdaptiveAvgPool2d, MaxUnpool1d, MaxUnpool2d)
from .norm import (LayerNorm, RMSNorm, GroupNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d,
                   InstanceNorm1d, InstanceNorm2d)
from .dropout import Dropout, Dropout1d, Dropout2d, Dropout3d
from .sparse import Embedding
from .activation import (ReLU, ReLU6, GELU, SiLU, Tanh, Sigmoid, LeakyReLU, ELU, SELU, CELU, Mish,
                         Hardtanh, Hardsigmoid, Hardswish, Softsign, Softplus, LogSigmoid, Softmax,
                         LogSoftmax, Softmin, GLU, PReLU, Threshold, Tanhshrink, Softshrink,
                         Hardshrink)
from .rnn import RNNCell, GRUCell, LSTMCell, RNNBase, RNN, LSTM, GRU
from .transformer import (MultiheadAttention, CausalSelfAttention, PositionalEncoding,
                          TransformerEncoderLayer, TransformerDecoderLayer, TransformerEncoder,
                          TransformerDecoder, Transformer)
from .loss import (MSELoss, L1Loss, SmoothL1Loss, HuberLoss, CrossEntropyLoss, NLLLoss, BCELoss,
                   BCEWithLogitsLoss, KLDivLoss)

__all__ = sorted(n for n, v in dict(globals()).items()
                 if not n.startswith("_") and (isinstance(v, type) or n == "Parameter"))
