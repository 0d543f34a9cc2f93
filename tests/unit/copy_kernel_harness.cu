// Host-side check of csrc/kvtier_copy.cu's per-warp copy schedule, for machines without a GPU.
//
// The kernel gives each descriptor to one warp; kvtier::copy_piece is what every lane of that
// warp runs. Lanes touch disjoint bytes, so running lane 0, 1, ..., lanes-1 one after another on
// the CPU produces exactly the bytes the warp produces on the device. This program does that for
// random (offset, offset, length) triples covering every alignment class (16/8/4/2/1-byte
// congruence, heads and tails of every length, lengths 0..5000 and a few large ones) and checks
// that the destination range equals the source and that no byte outside it changed.
// Built and run by tests/unit/test_copiers.py; prints "ok <cases>" and exits 0 on success.

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kvtier_copy.cu"

int main()
{
    const size_t buf = 1 << 19;
    const unsigned char sentinel = 0xEE;
    // 16-byte aligned storage so that offsets alone decide every alignment class.
    std::vector<uint4> src_store(buf / 16 + 1), dst_store(buf / 16 + 1);
    unsigned char* src = reinterpret_cast<unsigned char*>(src_store.data());
    unsigned char* dst = reinterpret_cast<unsigned char*>(dst_store.data());
    std::mt19937_64 rng(12345);
    for (size_t i = 0; i < buf; ++i) src[i] = static_cast<unsigned char>(rng());

    const unsigned lane_counts[] = {32, 7, 1};
    int cases = 0;
    for (int trial = 0; trial < 6000; ++trial) {
        const size_t soff = rng() % 4096, doff = rng() % 4096;
        size_t n = trial < 5000 ? static_cast<size_t>(trial) : 100000 + rng() % 300000;
        if (trial % 3 == 0) n = rng() % 70;  // many short pieces: heads and tails only
        const unsigned lanes = lane_counts[trial % 3];
        std::memset(dst, sentinel, buf);
        for (unsigned lane = 0; lane < lanes; ++lane)
            kvtier::copy_piece(reinterpret_cast<kvtier_u64>(dst + doff), reinterpret_cast<kvtier_u64>(src + soff), n,
                               lane, lanes);
        if (std::memcmp(dst + doff, src + soff, n) != 0) {
            std::printf("FAIL copy: soff=%zu doff=%zu n=%zu lanes=%u\n", soff, doff, n, lanes);
            return 1;
        }
        for (size_t i = 0; i < buf; ++i) {
            if ((i < doff || i >= doff + n) && dst[i] != sentinel) {
                std::printf("FAIL overrun at %zu: soff=%zu doff=%zu n=%zu lanes=%u\n", i, soff, doff, n, lanes);
                return 1;
            }
        }
        ++cases;
    }
    std::printf("ok %d\n", cases);
    return 0;
}
