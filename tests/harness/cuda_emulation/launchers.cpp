/* C entry points that launch each of aggnet's kernels (kernels.cu: the
 * text of aggnet.kernels.cuda_source.VECTOR_SOURCE) on the emulation, for
 * ctypes: the grid and block sizes first, then the kernel's own
 * arguments. */
#include "emulation.h"
#include "kernels.cu"

using u32 = unsigned int;
using u16 = unsigned short;
using i64 = long long;

extern "C" {
void run_quantize4(u32 g, u32 b, const u32* x, u32* out, i64 n, double scale, bool be) {
    emu::launch(g, b, false, [&] { aggnet_quantize4(x, out, n, scale, be); });
}
void run_dequantize4(u32 g, u32 b, const u32* q, u32* out, i64 n, double factor, bool be) {
    emu::launch(g, b, false, [&] { aggnet_dequantize4(q, out, n, factor, be); });
}
void run_to_half4(u32 g, u32 b, const u32* x, u16* out, i64 n, double m, bool scale, bool f16) {
    emu::launch(g, b, false, [&] { aggnet_to_half4(x, out, n, m, scale, f16); });
}
void run_from_half4(u32 g, u32 b, const u16* h, u32* out, i64 n, bool f16) {
    emu::launch(g, b, false, [&] { aggnet_from_half4(h, out, n, f16); });
}
void run_add_f32(u32 g, u32 b, u32* acc, const u32* src, i64 n) {
    emu::launch(g, b, false, [&] { aggnet_add_f32(acc, src, n); });
}
void run_add_half(u32 g, u32 b, u32* acc, const u16* src, i64 n, bool f16) {
    emu::launch(g, b, false, [&] { aggnet_add_half(acc, src, n, f16); });
}
void run_chunk_max_bits(u32 g, u32 b, const u32* x, u32* best, i64 n, i64 block, i64 per, i64 tile, bool vec) {
    emu::launch(g, b, true, [&] { aggnet_chunk_max_bits(x, best, n, block, per, tile, vec); });
}
void run_exponents_of_bits(u32 g, u32 b, const u32* best, short* out, i64 count) {
    emu::launch(g, b, false, [&] { aggnet_exponents_of_bits(best, out, count); });
}
void run_quantize_chunks(u32 g, u32 b, const u32* x, u32* out, i64 n, i64 block, const double* factors, bool vec) {
    emu::launch(g, b, false, [&] { aggnet_quantize_chunks(x, out, n, block, factors, vec); });
}
void run_dequantize_chunks(u32 g, u32 b, const u32* q, u32* out, i64 n, i64 block, const double* factors, bool vec) {
    emu::launch(g, b, false, [&] { aggnet_dequantize_chunks(q, out, n, block, factors, vec); });
}
}
