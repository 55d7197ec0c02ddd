// Autograd for the ops whose gradient formulas are Python (python_autograd.cpp).
#pragma once

#include <torch/extension.h>

#include <string>

namespace geot {

// The ops that take python_autograd.cpp's Autograd kernel; geot/_ops.py
// gives each its formula.
inline constexpr const char* kPythonAutogradOps[] = {
    "segment_reduce", "segment_broadcast", "gather_rows", "index_segment_reduce", "index_scatter_sum", "edge_dot",
    "edge_additive_score", "segment_matmul", "segment_matmul_transposed", "segment_matmul_weight_grad",
    "edge_softmax", "edge_softmax_backward", "attention_aggregate",
};

// formula(*args) -> outputs: runs the op and records its gradient (an
// autograd.Function's apply); called for the calls that record a gradient.
void set_python_autograd(const std::string& op_name, py::object formula);

}  // namespace geot
