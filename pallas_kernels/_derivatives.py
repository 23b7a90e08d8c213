"""Second-order derivatives for the kernels: the kernels compute values, a reference their
derivatives.

Pallas calls cannot be differentiated, so `jax.grad` of a kernel's `custom_vjp` works but grad
of grad and `jax.hessian` (forward over reverse) would differentiate the custom_vjp's backward
(and, for `jax.hessian`, its forward rule), which call kernels. Wrapped by `reference_tangents`,
those functions keep their kernel values and take the tangents of a pure-jnp function that
computes the same values; first-order use never runs the rule.
"""

import functools

import jax


def reference_tangents(kernel, reference):
    """`kernel(static, *arrays)` as a `jax.custom_jvp` (static: hashable, not differentiated)
    whose tangents are those of `reference(static, *arrays)`, a jnp function of the same
    arguments with the same outputs."""
    fn = jax.custom_jvp(kernel, nondiff_argnums=(0,))

    @fn.defjvp
    def rule(static, primals, tangents):
        _, output_tangents = jax.jvp(functools.partial(reference, static), primals, tangents)
        return fn(static, *primals), output_tangents

    functools.update_wrapper(fn, kernel)
    return fn
