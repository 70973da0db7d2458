// What every torch-facing op header starts from: torch's headers, and torch's bf16 type marked as
// bf16 for simd.h's conversions.
#pragma once

#include <torch/extension.h>

#include <type_traits>

#include "simd.h"

// torch's bf16 converts with bit operations (simd.h): loops over it then vectorise.
template <>
struct tessera::IsBf16<c10::BFloat16> : std::true_type {};
