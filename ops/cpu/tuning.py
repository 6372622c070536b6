"""The CPU kernels' tuning table: every threshold that chooses a kernel or cuts work into
pieces, once, with a one-line reason.

The measurements behind a value are in docs/performance.md, "Measurement history, by
constant", under the constant's name (the `history:` line below each one that has some):
a change of value should repeat them. The `*_NS` values are time estimates that
`compiled.split_rows` / `row_bounds` turn into a number of pieces, not limits.

Read by the ops' CPU kernels; this module imports nothing from ember.
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
KEEP_IMAGE_BYTES = 8 << 20  # a tiled route keeps a padded image this small: border zeroed once
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

# ---------------------------------------------------------------- ops/rnn.py: recurrences

RNN_TEAM_MIN_MACS = 1 << 16  # least multiply-adds of h R a thread for a step to be split
# history: docs/performance.md#rnn_team_min_macs-opsrnnpy

# ---------------------------------------------------------------- normalization, reductions

LAYERNORM_NS = 0.5  # the compiled LayerNormalization's time per value of a row
# history: docs/performance.md#layernorm_ns-opsnormalizationpy
SPATIAL_MEAN_NS_PER_VALUE = 1.0  # a global average pool's time per value, in a model
# history: docs/performance.md#spatial_mean_ns_per_value-opsreductionpy
SPATIAL_MEAN_MAX_PIXELS = 4096  # more rows summed in order lose what numpy's pairwise sums keep
SOFTMAX_COMPILED_MIN = 1 << 12  # elements below which a compiled softmax is not worth its call
SOFTMAX_NS_PER_VALUE = 1.3  # the compiled softmax's time per element
# history: docs/performance.md#softmax_ns_per_value-opsreductionpy

# ---------------------------------------------------------------- ops/pool.py, ops/shape.py

MAXPOOL_NS = 0.15  # the compiled MaxPool's time per window tap
# history: docs/performance.md#maxpool_ns-opspoolpy
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
