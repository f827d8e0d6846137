/* CUDA's half type as far as aggnet's kernels use it, on the host's
 * _Float16 (IEEE binary16, conversions rounded to nearest even). */
#pragma once
#include <cstring>

struct __half { _Float16 v; };
inline __half __float2half_rn(float f) { return {static_cast<_Float16>(f)}; }
inline float __half2float(__half h) { return static_cast<float>(h.v); }
inline unsigned short __half_as_ushort(__half h) {
    unsigned short u;
    std::memcpy(&u, &h.v, 2);
    return u;
}
inline __half __ushort_as_half(unsigned short u) {
    __half h;
    std::memcpy(&h.v, &u, 2);
    return h;
}
