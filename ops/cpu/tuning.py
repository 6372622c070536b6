"""The CPU kernels' tuning table: every threshold that chooses a kernel or cuts work into
pieces, once, with a one-line reason.

The measurements behind a value are in docs/performance.md, "Measurement history, by
constant", under the constant's name (the `history:` line below each one that has some):
a change of value should repeat them. The `*_NS` values are time estimates that
`compiled.split_rows` / `row_bounds` turn into a number of pieces, not limits (MIN_PIECE_NS
aside: the least estimated work of a piece).

Read by the ops' CPU kernels and the CPU engine; this module imports nothing from ember. The
few that compiled code reads (SPINS_BEFORE_YIELD, PREFETCH_AHEAD) are bound as plain globals
of the module that uses them (`NAME = tuning.NAME`): numba freezes a global's value when it
compiles, and its disk cache does not see a change made here, so after changing one delete the
caches (ops/cpu/compiled.py's docstring).
"""

# ---------------------------------------------------------------- ops/conv.py: convolutions

IM2COL_CHUNK = 1 << 18  # patch-matrix elements per chunk of groups: a chunk stays in cache
# history: docs/performance.md#im2col_chunk-opsconvpy
IMAGE_CHANNELS = 4  # at most this many input channels: a first layer (RGB, RGBA, gray)
# history: docs/performance.md#_tiledroute-opsconvpy

DEPTHWISE_BAND_BYTES = 512 << 10  # a band's input rows stay in cache for every channel block
# history: docs/performance.md#depthwise_band_bytes-opsconvpy
DEPTHWISE_VECTOR_NS = 0.06  # the vector depthwise kernel's time per tap of an output value
# history: docs/performance.md#depthwise_vector_ns-opsconvpy
DEPTHWISE_INPUT_NS_PER_BYTE = 0.2  # split by input too: a thread reads rows its core wrote
# history: docs/performance.md#depthwise_input_ns_per_byte-opsconvpy
DEPTHWISE_TAP_NS = 0.12  # the numba depthwise kernels' time per tap of an output value
# history: docs/performance.md#depthwise_tap_ns-opsconvpy

NARROW_TILES_MAX_K = 1536  # AVX2's tiles: most terms (taps x channels) before BLAS wins
# history: docs/performance.md#narrow_tiles_max_k-opsconvpy
POINTWISE_TILE_CHANNELS = (512, 2049)  # a 1x1 conv's input channels [lo, hi) where tiles win
# history: docs/performance.md#pointwise_tile_channels-pointwise_tile_min_macs-opsconvpy
POINTWISE_TILE_MIN_MACS = 1 << 24  # and its least pixels x input x output channels for them
# history: docs/performance.md#pointwise_tile_channels-pointwise_tile_min_macs-opsconvpy
GROUPED_MIN_WIDTH = 8  # output channels a group from which groups run as block-diagonal tiles
# history: docs/performance.md#grouped_min_width-opsconvpy
TILES_MIN_OUTPUTS = 8  # output channels from which the tiles run a conv: fewer waste a block
# history: docs/performance.md#tiles_min_outputs-opsconvpy
KEEP_IMAGE_BYTES = 8 << 20  # a route or 8-bit plan keeps a padded image this small: border once
# history: docs/performance.md#keep_image_bytes-opsconvpy
PAD_NS_PER_VALUE = 0.4  # a padded image's row copy: time per value read and written
# history: docs/performance.md#pad_ns_per_value-opsconvpy

SHIFTED_CHANNELS = (16, 128)  # the input channels for which shifted GEMMs beat im2col
# history: docs/performance.md#shifted_channels-shifted_min_pixels-shifted_chunk-opsconvpy
SHIFTED_MIN_PIXELS = 4096  # and the least output pixels per image (64x64)
# history: docs/performance.md#shifted_channels-shifted_min_pixels-shifted_chunk-opsconvpy
SHIFTED_CHUNK = 1 << 15  # output pixels per tap's GEMM: whole images, few BLAS calls
# history: docs/performance.md#shifted_channels-shifted_min_pixels-shifted_chunk-opsconvpy
PATCH_ROWS_MIN_CHANNELS = 16  # channels-last patch rows from here: shorter runs copy slowly
# history: docs/performance.md#patch_rows_min_channels-opsconvpy

# ---------------------------------------------------------------- ops/linalg.py: products

BY_ROW_KN = {2: 1 << 16, 3: 1 << 16, 4: 1 << 19}  # rows -> K*N from which a GEMV a row wins
# history: docs/performance.md#by_row_kn-opslinalgpy
BY_ROW_MIN_KN = min(BY_ROW_KN.values())  # the cheap first test of BY_ROW_KN

DOT_ROWS = range(4, 13)  # rows that dot products with a constant weight's transpose serve
# history: docs/performance.md#dot_rows-dot_min_kn-opslinalgpy
DOT_MIN_KN = 1 << 20  # the least weight (K*N) for them: smaller ones BLAS does as fast
# history: docs/performance.md#dot_rows-dot_min_kn-opslinalgpy
DOT_NS_PER_MAC = 0.05  # their time per multiply-add of a column

TILE_ROWS = range(2, 513)  # rows by a constant weight as tiles: from ~400 BLAS is as fast
# history: docs/performance.md#tile_rows-tile_any_k_rows-tile_min_kn-opslinalgpy
TILE_ANY_K_ROWS = range(2, 17)  # a decoder step's rows: tiles for any K, and on AVX2
# history: docs/performance.md#tile_rows-tile_any_k_rows-tile_min_kn-opslinalgpy
TILE_MAX_K = 3072  # longer sums: the weights no longer stay in cache between tiles
# history: docs/performance.md#tile_max_k-opslinalgpy
TILE_MIN_KN = 1 << 18  # the least weight (K*N) worth packing for the tiles
# history: docs/performance.md#tile_rows-tile_any_k_rows-tile_min_kn-opslinalgpy
TILE_WIDE_N = 16384  # a wider weight (a vocabulary) spreads a tile's stores far apart
# history: docs/performance.md#tile_wide_n-tile_wide_n_rows-opslinalgpy
TILE_WIDE_N_ROWS = range(2, 49)  # so it is tiled for these rows only
# history: docs/performance.md#tile_wide_n-tile_wide_n_rows-opslinalgpy

# ---------------------------------------------------------------- ops/microsoft/lowbit.py

NBITS_GEMV_ROWS = 16  # MatMulNBits rows up to which the 4-bit GEMV beats BLAS on a float copy
# history: docs/performance.md#nbits_gemv_rows-nbits_gemv_ns_per_byte-opsmicrosoftlowbitpy
NBITS_GEMV_NS_PER_BYTE = 0.13  # the 4-bit GEMV's time per byte of codes and row, for the split
# history: docs/performance.md#nbits_gemv_rows-nbits_gemv_ns_per_byte-opsmicrosoftlowbitpy

# ---------------------------------------------------------------- ops/rnn.py: recurrences

RNN_TEAM_MIN_MACS = 1 << 16  # least multiply-adds of h R a thread for a step to be split
# history: docs/performance.md#rnn_team_min_macs-opsrnnpy

# ---------------------------------------------------------------- normalization, reductions

LAYERNORM_NS = 0.5  # the compiled LayerNormalization's time per value of a row
# history: docs/performance.md#layernorm_ns-opsnormalizationpy
GROUPNORM_NS = 0.25  # the compiled Instance / GroupNormalization's time per value of a group
# history: docs/performance.md#groupnorm_ns-channel_affine_ns-opsnormalizationpy
CHANNEL_AFFINE_NS = 0.1  # the compiled BatchNormalization's time per value (one pass)
# history: docs/performance.md#groupnorm_ns-channel_affine_ns-opsnormalizationpy
SPATIAL_MEAN_NS_PER_VALUE = 1.0  # a global average pool's time per value, in a model
# history: docs/performance.md#spatial_mean_ns_per_value-opsreductionpy
SPATIAL_MEAN_MAX_PIXELS = 4096  # pixels a piece sums in order: more lose what pairwise sums keep
SOFTMAX_COMPILED_MIN = 1 << 12  # elements below which a compiled softmax is not worth its call
SOFTMAX_NS_PER_VALUE = 1.3  # the compiled softmax's time per element
SOFTMAX_COLUMNS = 256  # columns a piece of a softmax over another axis than the last
# history: docs/performance.md#softmax_columns-opsreductionpy
# history: docs/performance.md#softmax_ns_per_value-opsreductionpy

# ---------------------------------------------------------------- ops/pool.py, ops/shape.py

MAXPOOL_NS = 0.15  # the compiled MaxPool's time per window tap
# history: docs/performance.md#maxpool_ns-opspoolpy
RESIZE_NS_PER_TAP = 0.35  # the compiled Resize's time per tap of an output row (a gather each)
# history: docs/performance.md#resize_ns_per_tap-opsimagepy
TRANSPOSE_BLOCK = 64  # rows per band: the band and its transposed image stay in L1/L2
# history: docs/performance.md#transpose_block-opsshapepy
CONCAT_NS_PER_VALUE = 0.3  # the compiled channels-last concatenation's time per value copied
# history: docs/performance.md#concat_ns_per_value-opsshapepy

# ---------------------------------------------------------------- ops/_epilogue.py, activations

EPILOGUE_MIN = 1 << 14  # elements below which numpy's passes are as fast (GELU's aside)
# history: docs/performance.md#epilogue_min-epilogue_ns-ops_epiloguepy
EPILOGUE_NS = 0.3  # the compiled epilogue's time per element, GELU's aside
# history: docs/performance.md#epilogue_min-epilogue_ns-ops_epiloguepy
GELU_NS = 1.5  # GELU's own time per element (float32), in the epilogue and on its own
# history: docs/performance.md#gelu_ns-ops_epiloguepy-opsactivationspy
GELU_COMPILED_MIN = 1 << 14  # below, not worth a call (a thread's share is at least half)

# ---------------------------------------------------------------- ops/cpu/compiled.py: splits

MIN_PIECE_NS = 15_000  # a kernel's piece's least work: a piece handed over waits for a core
# history: docs/performance.md#min_piece_ns-opscpucompiledpy
HELPER_PAUSES = 1000  # a helper's spin for a next job during a run: a wake-up costs more
# history: docs/performance.md#helper_pauses-settle_pauses-opscpucompiledpy
SETTLE_PAUSES = 200  # and once one is posted: its caller still holds the GIL (wait_for_job)
# history: docs/performance.md#helper_pauses-settle_pauses-opscpucompiledpy
POOL_PRODUCTS_HELPER_PAUSES = 20_000  # HELPER_PAUSES where the pool runs the products too
# history: docs/performance.md#pool_products_helper_pauses-opscpucompiledpy
SPINS_BEFORE_YIELD = 1000  # pauses before a thread waiting for others yields its core
# history: docs/performance.md#spins_before_yield-opscpucompiledpy

# ---------------------------------------------------------------- ops/cpu/blas.py: products

PIECE_MACS = 1 << 18  # a product's piece's least multiply-adds: OpenBLAS's own for a thread
ROWS_CUT_MIN_ROWS = 128  # from so many rows, a product by small weights is cut into rows
# history: docs/performance.md#rows_cut_min_rows-rows_cut_max_weight_bytes-opscpublaspy
ROWS_CUT_MAX_WEIGHT_BYTES = 1 << 20  # larger weights: each piece of rows would read them all
# history: docs/performance.md#rows_cut_min_rows-rows_cut_max_weight_bytes-opscpublaspy
GEMV_MIN_VALUES = 1 << 20  # a GEMV's least matrix values to be cut: smaller gain no thread
# history: docs/performance.md#gemv_min_values-opscpublaspy
LINGER_PAUSES = 6000  # a helper's spin on the board after a run: the next run finds it awake
# history: docs/performance.md#linger_pauses-opscpublaspy

# ---------------------------------------------------------------- ops/cpu/tiles.py: tiles

PREFETCH_AHEAD = 2048  # floats (8 KB) the tiles prefetch ahead of the weights they read
# history: docs/performance.md#prefetch_ahead-opscputilespy
CORE_GFLOPS = 100  # the AVX-512 tiles' rate on one core, for split_rows' estimate
# history: docs/performance.md#core_gflops-core_gflops_avx2-opscputilespy
CORE_GFLOPS_AVX2 = 60  # AVX2's tiles': a guess from its peak (it only decides the split)
# history: docs/performance.md#core_gflops-core_gflops_avx2-opscputilespy
BAND_BYTES = 192 << 10  # a band's input stays in a core's L2 beside one block of weights
# history: docs/performance.md#band_bytes-opscputilespy
ONE_BAND_BYTES = 1 << 20  # an input this small is one band: each band reads all weights again
# history: docs/performance.md#one_band_bytes-one_band_weights_ratio-opscputilespy
ONE_BAND_WEIGHTS_RATIO = 4  # up to twice that where the weights are this many times the input
# history: docs/performance.md#one_band_bytes-one_band_weights_ratio-opscputilespy
ROWS_SPLIT_WEIGHTS_RATIO = 1  # weights at most this x the output: pieces of whole bands
# history: docs/performance.md#rows_split_weights_ratio-opscputilespy
STREAM_FROM_BYTES = 32 << 20  # outputs this large are stored around the caches
# history: docs/performance.md#stream_from_bytes-opscputilespy
ALIGN_FROM_BYTES = 64 << 10  # arrays this large are cache-line aligned: smaller gain less
# history: docs/performance.md#align_from_bytes-opscputilespy

# ---------------------------------------------------------------- ops/cpu/threads.py, memory.py

THREAD_TIMEOUT = 18  # log2 of the cycles OpenBLAS's workers spin: a run's products, not after
# history: docs/performance.md#thread_timeout-opscputhreadspy
TRIM_THRESHOLD = 256 << 20  # freed bytes glibc keeps at its heap's top for the next run
KEEP_BUFFER_BYTES = 2 << 30  # tiles.empty keeps freed buffers of 32 MiB and more up to this
# history: docs/performance.md#keep_freed_memory-opscpumemorypy

# ---------------------------------------------------------------- ops/ml.py: tree ensembles

TREE_STEP_NS = 9.0  # a compiled tree walk's time per tree level of a row, for split_rows
# history: docs/performance.md#tree_step_ns-opsmlpy
TREE_GROUP_STEP_NS = 8.0  # the paired walk's time per step of a row down eight trees at once
# history: docs/performance.md#tree_group_step_ns-opsmlpy

# ---------------------------------------------------------------- ops/cpu/integer.py: 8-bit products

INT_MAC_NS = 0.012  # the VNNI tile's time per multiply-add on one core, for split_rows
# history: docs/performance.md#int_mac_ns-int_pack_ns-int_min_macs-opscpuintegerpy
INT_PACK_NS = 0.5  # packing's time per activation byte (a patch's gather is most of it)
# history: docs/performance.md#int_mac_ns-int_pack_ns-int_min_macs-opscpuintegerpy
INT_MIN_MACS = 1 << 18  # below, the float64 BLAS product's one call beats packing's fixed cost
# history: docs/performance.md#int_mac_ns-int_pack_ns-int_min_macs-opscpuintegerpy
INT_GROUP_ROWS = 8  # a grouped 8-bit convolution's least output channels a group for the tiles
# history: docs/performance.md#int_mac_ns-int_pack_ns-int_min_macs-opscpuintegerpy

# ---------------------------------------------------------------- quantised element-wise ops

QLINEAR_COMPILED_MIN = 1 << 14  # values below which numpy's passes are as fast as a call
# history: docs/performance.md#the-quantised-element-wise-loops-opscpuqlinearpy
QLINEAR_CHUNK = 1 << 14  # values of R a compiled row holds: a flat tensor still splits
QLINEAR_ADD_NS = 0.15  # QLinearAdd's compiled time per value (two fused multiply-adds)
# history: docs/performance.md#the-quantised-element-wise-loops-opscpuqlinearpy
QLINEAR_ADD_COMPILED_MIN = 1  # QLinearAdd's: numpy's emulated fma lose at every size
# history: docs/performance.md#the-quantised-element-wise-loops-opscpuqlinearpy
QLINEAR_MUL_NS = 0.5  # QLinearMul's compiled time per value
QUANTIZE_NS = 0.15  # a compiled QuantizeLinear's time per value (a float32 division)
DEQUANTIZE_NS = 0.06  # a compiled DequantizeLinear's time per value
LOOKUP_NS = 0.3  # QLinearSigmoid / LeakyRelu's table lookup, per value
QLINEAR_POOL_NS = 0.05  # QLinearGlobalAveragePool's integer sum, per value
# history: docs/performance.md#the-quantised-element-wise-loops-opscpuqlinearpy
INT_DEPTHWISE_NS = 0.1  # the 8-bit depthwise loop's time per tap of a channel, for split_rows
# history: docs/performance.md#int_mac_ns-int_pack_ns-int_min_macs-opscpuintegerpy
INT_DEPTHWISE_PLANE_WIDTH = 16  # output rows this wide at stride 1 vectorise along the row
# history: docs/performance.md#int_mac_ns-int_pack_ns-int_min_macs-opscpuintegerpy

# ---------------------------------------------------------------- ops/elementwise_chain.py

CHAIN_COMPILED_MIN = 1 << 6   # inputs all below this many values: numpy's ops, not the loop
CHAIN_ALONE_MIN = 1 << 18     # a single one-pass elementwise op this large: a chain
CHAIN_FORMULA_ALONE_MIN = 1 << 13   # a single Sigmoid, Tanh, Exp... this large: a chain
# history: docs/performance.md#chain_compiled_min-opselementwise_chainpy

# ---------------------------------------------------------------- ops/linalg.py: one-row GEMV

GEMV_ROWS = range(1, 2)  # rows by a constant weight that ops/cpu/gemv.py's GEMV serves
# history: docs/performance.md#gemv_rows-gemv_min_kn-gemv_ns_per_value-opscpugemvpy
GEMV_MIN_KN = 1 << 16  # the least weight (K*N) packed for it: smaller ones BLAS does as fast
# history: docs/performance.md#gemv_rows-gemv_min_kn-gemv_ns_per_value-opscpugemvpy
GEMV_NS_PER_VALUE = 0.16  # its time per weight value on one core (~25 GB/s), for the split
# history: docs/performance.md#gemv_rows-gemv_min_kn-gemv_ns_per_value-opscpugemvpy

# ---------------------------------------------------------------- ops/attention.py: a step

ATTEND_MAX_ROWS = 16  # query rows a kv head up to which a decoder step's attention is compiled
# history: docs/performance.md#attend_max_rows-attend_ns_per_mac-opsattentionpy
ATTEND_NS_PER_MAC = 0.07  # its time per multiply-add on one core, for the split
# history: docs/performance.md#attend_max_rows-attend_ns_per_mac-opsattentionpy

# ------------------------------------------------------------- ops/conv.py: small 1-D convolutions

DIRECT_CONV_MACS = 1 << 20  # up to so many multiply-adds a 1-D convolution is computed directly
# history: docs/performance.md#direct_conv_macs-direct_ns_per_mac-opsconvpy
DIRECT_NS_PER_MAC = 0.1  # the direct loop's time per multiply-add on one core, for the split
# history: docs/performance.md#direct_conv_macs-direct_ns_per_mac-opsconvpy
