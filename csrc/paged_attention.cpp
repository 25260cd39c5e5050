// paged_attention: the checks that need the tables' contents, the K/V store, and the kernel choice.
#include "paged_attention.h"

namespace nodekv::ops {

int paged_attention(const PagedArgs& a) {
    const int64_t n_blocks = (a.end + a.page_size - 1) / a.page_size;
    for (int64_t i = 0; i < n_blocks; ++i)
        if (a.block_table[i] < 0 || a.block_table[i] >= a.n_pages) return kBadBlockTable;
    if (a.mass) {
        const int32_t* b = a.node_bounds;
        if (a.n_nodes < 1 || b[0] != 0 || b[a.n_nodes] != a.end) return kBadNodeBounds;
        for (int64_t j = 0; j < a.n_nodes; ++j)
            if (b[j + 1] <= b[j]) return kBadNodeBounds;
    }
    if (a.k_new)
        for (int64_t t = 0; t < a.T; ++t)
            for (int64_t g = 0; g < a.kv_heads; ++g)
                a.store(a.end - a.T + t, g, a.k_new + t * a.k_new_stride_t + g * a.k_new_stride_h,
                        a.v_new + t * a.v_new_stride_t + g * a.v_new_stride_h);
    if (a.n <= 0) return kPagedOk;
    if (a.n <= kDecodeMaxQueries)
        decode_attention(a);
    else
        prefill_attention(a);
    return kPagedOk;
}

}  // namespace nodekv::ops
