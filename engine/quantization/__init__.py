"""Weight formats ("quantization methods"), one module each, registered by name.

A `engine.models.linear.Linear` of ``quantization=q`` multiplies through
``method_for(q)``: float weights (`dense`, q None), int8 and int4 packed from float
weights at load (`int8`, `int4`), and a GGUF's own blocks (`gguf`). Importing this package
imports every format, so the registry is whole before anyone reads it.
"""

from engine.quantization.base import (
    METHODS,
    QuantizationMethod,
    check_shape,
    kernel_for,
    method_for,
    register,
    weight_rows,
)
from engine.quantization.dense import DenseMethod
from engine.quantization.gguf import GGUF, GGUFMethod
from engine.quantization.int4 import Int4Method
from engine.quantization.int8 import Int8Method

__all__ = [
    "GGUF",
    "METHODS",
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
