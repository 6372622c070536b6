"""Ops the simplifier fuses into, in the domain "ai.ember" (version 1), with their CPU kernels.

    ai.ember::FusedConv(X, W, B?, Z?)      act(Conv(X, W, B) + Z): Conv attributes + activation
    ai.ember::FusedGemm(A, B, C?)          Gemm attributes (all given) + activation
    ai.ember::FusedMatMul(A, B, bias?, Z?) act(A @ B + bias + Z), bias over the last axis

Z, the residual, has exactly the shape of the result.

`activation` names the ONNX activation applied to the result ("Relu", "LeakyRelu", "Clip",
"Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Gelu", "Swish"; "" for none) and
`activation_params` holds its float parameters in the ONNX attribute order (Clip: min, max;
LeakyRelu: alpha; HardSigmoid: alpha, beta; Gelu: 1.0 for the tanh approximation; Swish:
alpha, x * sigmoid(alpha x), which the simplifier also makes of SiLU written out). The activation is applied in
place on the freshly computed product, as are the bias and the residual: fusion saves the
separate ops' allocations (and, for GELU, runs the formula block by block in cache).
"""
from __future__ import annotations

import numpy as np

from ember.ops.cpu import blas as _blas, compiled as _compiled
from ember.ops._epilogue import (ACTIVATIONS, PointwiseRoute, activation_in_loops, epilogue,
                                 pointwise_route, tiles_pointwise_fits, tiles_pointwise_route,
                                 with_defaults)
from ember.ops._layout import pixel_rows
from ember.ops.conv import (Conv, RouteMemo, clamps_in_pass, depthwise_activates,
                            pointwise_cl_fits, pointwise_weights)
from ember.ops.linalg import CachedPack, Gemm7, matmul, product_lowering
from ember.ops.registry import OpImpl, register

DOMAIN = "ai.ember"


class _Activated(OpImpl):
    """Base of the fused ops: reads the activation attributes once, applies the epilogue over
    `self.xp`."""

    def _activation_setup(self):
        self.activation_name = getattr(self, "activation", "") or ""
        if isinstance(self.activation_name, bytes):
            self.activation_name = self.activation_name.decode()
        if self.activation_name not in ACTIVATIONS:
            raise self.fail(f"unknown activation {self.activation_name!r}")
        self.activation_args = [float(v) for v in (getattr(self, "activation_params", None)
                                                   or [])]

    def finish(self, y, bias=None, z=None, channel_bias=None):
        if z is not None and z.shape != y.shape:
            raise self.fail(f"residual Z has shape {z.shape}, the result {y.shape}")
        return epilogue(self.xp, y, bias, z, self.activation_name, self.activation_args,
                        channel_bias)


@register("FusedConv", versions=[1], domain=DOMAIN)
class FusedConv(Conv, _Activated):
    def setup(self):
        super().setup()
        self._activation_setup()
        # the activation as a clip to [lo, hi] (none, ReLU, ReLU6): a depthwise kernel then
        # adds the bias and clips in its own pass, with no epilogue pass after it
        name, params = self.activation_name, with_defaults(self.activation_name,
                                                            self.activation_args)
        self._clamp = {"": (-np.inf, np.inf), "Relu": (0.0, np.inf),
                       "Clip": tuple(params[:2])}.get(name)
        # another activation the depthwise vector kernel applies to its rows in cache
        # (SiLU, HardSwish): a clamp of (lo, hi, code, p0, p1) (conv.depthwise_activates)
        in_loops = activation_in_loops(name, params, np.float32)
        self._activating = None if self._clamp is not None or in_loops is None \
            else (-np.inf, np.inf, *in_loops)
        self._fused_routes = RouteMemo()   # where run's whole result is the route's

    def run(self, x, w, b=None, z=None):
        route = self._fused_routes.route(x, w, b, z)
        if route is not None:   # (a depthwise route takes no residual)
            return route.run(x) if z is None else route.run(x, z)
        if self._clamp is not None and z is None:
            kernel, strides, dilations, begin, end = self.geometry(x, w)
            if clamps_in_pass(self.xp, x, w, self.group, kernel, strides, dilations, begin,
                              end):
                return super().run(x, w, b, clamp=self._clamp, routes=self._fused_routes)
        if self._activating is not None and z is None:
            kernel, _, _, begin, end = self.geometry(x, w)
            if depthwise_activates(self.xp, x, w, self.group, kernel, begin, end):
                return super().run(x, w, b, clamp=self._activating, routes=self._fused_routes)
        if b is not None and self.xp is np and x.dtype in (np.float32, np.float64) \
                and b.size == w.shape[0] and x.ndim >= 3:
            # the epilogue adds the bias: the convolution then neither copies its input
            # beside a ones row nor makes a pass of its own over the output for it
            route = self._pointwise_route(x, w, b, z)
            if route is not None:
                self._chosen = route.lowering
                self._fused_routes.remember(x, w, b, z, route)
                return route.run(x, z)
            return self.finish(super().run(x, w), z=z, channel_bias=b)
        return self.finish(super().run(x, w, b), z=z)


    def _pointwise_route(self, x, w, b, z) -> PointwiseRoute | None:
        """The route for this input geometry during a run (made on its first call), where
        this is a 1x1 convolution whose product goes on the board; else None. Kept in the
        weights' cache (a new weight array starts anew), by the bias's identity: both are
        constants (read-only) where there is a route, kept alive by the op's inputs."""
        if not _blas.in_run():
            return None
        _, cache = self.weight_and_cache(w, None, x.dtype)
        key = ("pointwise-route", x.shape, x.strides, x.dtype, id(b),
               None if z is None else (z.shape, z.strides, z.dtype), _compiled.run_threads())
        route = cache.get(key, False)
        if route is False:
            cache[key] = route = self._new_pointwise_route(x, w, b, z, cache)
        return route

    def _new_pointwise_route(self, x, w, b, z, cache) -> PointwiseRoute | None:
        kernel, strides, _, begin, end = self.geometry(x, w)
        out_shape = (x.shape[0], w.shape[0], *x.shape[2:])
        if (z is None or (z.shape == out_shape and z.dtype == x.dtype
                          and pixel_rows(z) is not None)) \
                and tiles_pointwise_fits(x, w, b, self.group, strides, begin, end):
            wc, _ = self.weight_and_cache(w, None, x.dtype)
            route = tiles_pointwise_route(x, wc, b.reshape(-1), z, self._clamp,
                                          self.activation_name, self.activation_args)
            if route is not None:
                return route
        if self.group != 1 or any(s != 1 for s in strides) or w.flags.writeable \
                or b.flags.writeable or (z is not None and pixel_rows(z) is None) \
                or not pointwise_cl_fits(np, x, w, self.group, kernel, begin, end):
            return None   # (weights and bias computed in the run are not kept)
        wc, _ = self.weight_and_cache(w, None, x.dtype)
        return pointwise_route(x, pointwise_weights(wc, cache), b, z, self.activation_name,
                               self.activation_args)


@register("FusedGemm", versions=[1], domain=DOMAIN)
class FusedGemm(Gemm7, _Activated):
    def setup(self):
        for name, default in (("alpha", 1.0), ("beta", 1.0), ("transA", 0), ("transB", 0)):
            if getattr(self, name, None) is None:
                setattr(self, name, default)
        super().setup()
        self._activation_setup()

    def run(self, a, b, c=None):
        return self.finish(super().run(a, b, c))


@register("FusedMatMul", versions=[1], domain=DOMAIN)
class FusedMatMul(_Activated):
    def setup(self):
        self._activation_setup()
        self._transposed = CachedPack()  # of a constant B, for products of a few rows

    def run(self, a, b, bias=None, z=None):
        self.settle_lowering(a, b)
        if a.ndim == 0 or b.ndim == 0 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
            raise self.fail(f"shapes {a.shape} and {b.shape} are not aligned")
        xp = self.xp
        y = matmul(xp, a, b, self._transposed if 1 in self.constant_inputs else None)
        return self.finish(xp.asarray(y), bias, z)  # vector . vector: a scalar

    def lower(self, inputs):
        product = product_lowering(inputs[0], inputs[1], inputs[1] is not None
                                   and inputs[1].value is not None)
        return product._replace(why=product.why + "; bias, residual and activation in one "
                                "compiled pass after it")
