"""Weight formats ("quantization methods"), one module each, registered by name.

A `engine.models.linear.Linear` of ``quantization=q`` multiplies through
``method_for(q)``: float weights (`dense`, q None), int8 and int4 packed from float
weights at load (`int8`, `int4`), and a GGUF's own blocks (`gguf`). Importing this package
imports every format, so the registry is whole before anyone reads it.
"""

from engine.config import from_float_formats
from engine.quantization.base import (
    METHODS,
    QuantizationMethod,
    check_shape,
    kernel_for,
    method_for,
    register,
    weight_rows,
)

# The registry keeps the order these run in, which `QUANTIZATIONS` (--quantization's
# choices) shows: int8 before int4.
# isort: off
from engine.quantization.dense import DenseMethod
from engine.quantization.int8 import Int8Method
from engine.quantization.int4 import Int4Method
from engine.quantization.gguf import GGUF, GGUFMethod

# isort: on

# the weight formats `Linear` packs from float weights (what --quantization may ask for)
QUANTIZATIONS = from_float_formats()

__all__ = [
    "GGUF",
    "METHODS",
    "QUANTIZATIONS",
    "DenseMethod",
    "GGUFMethod",
    "Int4Method",
    "Int8Method",
    "QuantizationMethod",
    "check_shape",
    "kernel_for",
    "method_for",
    "register",
    "weight_rows",
]
