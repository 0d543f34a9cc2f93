/*
 * kvtier_copy.cu: the batched copy kernel of kvtier's CUDA copier (kvtier/cuda.py).
 *
 * One launch moves every piece of a store or load job: thousands of (block x layer x page)
 * pieces between the paged GPU KV cache and the host region's pages, in either direction.
 * Per-piece cudaMemcpyAsync costs microseconds of launch overhead per piece, and in-engine
 * batch-memcpy APIs have been seen to fail past tens of thousands of entries; this kernel has
 * neither limit.
 *
 * Contract of kvtier_batched_copy(src, dst, nbytes, count):
 *   - src, dst, nbytes are device-readable arrays of `count` unsigned 64-bit integers (kvtier
 *     uploads them to device memory before the launch). Descriptor i copies nbytes[i] bytes
 *     from address src[i] to address dst[i]; nbytes[i] may be 0 and may be any size.
 *   - Every address must be dereferenceable by the launching device: device memory of that
 *     device (or of a peer with access enabled), or host memory registered with
 *     cudaHostRegister(..., cudaHostRegisterMapped) on a system where the registered host
 *     pointer is also the device pointer (UVA with
 *     cudaDevAttrCanUseHostPointerForRegisteredMem; the copier checks this before use).
 *     Pageable, unregistered host memory is NOT allowed: the kernel would fault.
 *   - No descriptor's source range may overlap any descriptor's destination range (a store
 *     reads the KV cache and writes the region, a load the reverse), so the order in which
 *     pieces move is irrelevant.
 *   - Any grid shape works: blockDim.x must be a multiple of 32, and each warp takes
 *     descriptors i = warp, warp + warps, ... (grid-stride), so one launch covers any count,
 *     1,000,000 descriptors and beyond, with a grid sized to the device rather than the job.
 *     The copier also splits large descriptors into bounded chunks on the host so that one
 *     huge piece does not serialise on a single warp; the kernel is correct without that.
 *   - Bytes are copied with the widest access that both addresses allow: 16-byte vectors when
 *     src and dst are congruent mod 16 (after a short byte head that brings both to a 16-byte
 *     boundary, and with a byte tail), else 8-, 4- or 2-byte words under the same rule, else
 *     single bytes. Misaligned pieces are therefore safe, only slower.
 *   - Completion is stream-ordered: the copier records a CUDA event after the launch; the
 *     bytes are in place (and visible to the host for mapped memory) once that event completed.
 *
 * The file includes no headers so that NVRTC (cupy.RawModule) compiles it as is; `nvcc
 * -Werror all-warnings` compiles it in CI. The per-warp copy routines are __host__
 * __device__ so that a CPU-only test (tests/unit/test_copiers.py) checks the exact lane
 * schedule the kernel runs, by running every lane in turn on the host.
 */

typedef unsigned long long kvtier_u64;

namespace kvtier {

// Copy n bytes with one warp (this thread is lane `lane` of `lanes`), using W-sized words for
// the body. Precondition: src and dst are congruent modulo sizeof(W), so the byte head that
// aligns src also aligns dst.
template <typename W>
__host__ __device__ __forceinline__ void copy_coaligned(unsigned char* dst, const unsigned char* src, kvtier_u64 n,
                                                        unsigned lane, unsigned lanes)
{
    const kvtier_u64 w = sizeof(W);
    kvtier_u64 head = (w - (reinterpret_cast<kvtier_u64>(src) & (w - 1))) & (w - 1);
    if (head > n) head = n;
    for (kvtier_u64 j = lane; j < head; j += lanes) dst[j] = src[j];

    const kvtier_u64 words = (n - head) / w;
    const W* s = reinterpret_cast<const W*>(src + head);
    W* d = reinterpret_cast<W*>(dst + head);
    kvtier_u64 i = lane;
    // Four independent loads before the stores: host-mapped memory is a PCIe round trip away,
    // and keeping several requests in flight per lane is what approaches the link's bandwidth.
    for (; i + 3ull * lanes < words; i += 4ull * lanes) {
        const W a = s[i], b = s[i + lanes], c = s[i + 2ull * lanes], e = s[i + 3ull * lanes];
        d[i] = a;
        d[i + lanes] = b;
        d[i + 2ull * lanes] = c;
        d[i + 3ull * lanes] = e;
    }
    for (; i < words; i += lanes) d[i] = s[i];

    for (kvtier_u64 j = head + words * w + lane; j < n; j += lanes) dst[j] = src[j];
}

// One descriptor, copied by one warp: pick the widest word both addresses can share.
__host__ __device__ __forceinline__ void copy_piece(kvtier_u64 dst, kvtier_u64 src, kvtier_u64 n, unsigned lane,
                                                    unsigned lanes)
{
    unsigned char* d = reinterpret_cast<unsigned char*>(dst);
    const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
    const kvtier_u64 skew = src ^ dst;
    if ((skew & 15) == 0)
        copy_coaligned<uint4>(d, s, n, lane, lanes);
    else if ((skew & 7) == 0)
        copy_coaligned<kvtier_u64>(d, s, n, lane, lanes);
    else if ((skew & 3) == 0)
        copy_coaligned<unsigned int>(d, s, n, lane, lanes);
    else if ((skew & 1) == 0)
        copy_coaligned<unsigned short>(d, s, n, lane, lanes);
    else
        copy_coaligned<unsigned char>(d, s, n, lane, lanes);
}

}  // namespace kvtier

extern "C" __global__ void kvtier_batched_copy(const kvtier_u64* __restrict__ src, const kvtier_u64* __restrict__ dst,
                                               const kvtier_u64* __restrict__ nbytes, kvtier_u64 count)
{
    const unsigned lane = threadIdx.x % 32u;
    const kvtier_u64 warp = (static_cast<kvtier_u64>(blockIdx.x) * blockDim.x + threadIdx.x) / 32u;
    const kvtier_u64 warps = static_cast<kvtier_u64>(gridDim.x) * blockDim.x / 32u;
    for (kvtier_u64 i = warp; i < count; i += warps)
        kvtier::copy_piece(dst[i], src[i], nbytes[i], lane, 32u);
}
