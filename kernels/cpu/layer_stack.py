"""A model's layers handed to a C++ forward built on ``layer_stack.h`` (``Int8Draft``, ``BlockModel``).

Both classes take the same constructor (heads, kv heads, head_dim, hidden size, rms eps, attention scale, final
norm) and one ``add_layer`` per layer (fused q/k/v weight and bias, o weight and bias, fused gate/up weight, down
weight, the two norms), each weight as its ``native(level)`` object. The object is made once per model and
level, kept on the model, and made again if the model's layers or final norm were replaced.
"""

from __future__ import annotations

__all__ = ["held_stack"]


def _f32(t):
    return None if t is None else t.float().contiguous()


def held_stack(model, cls, level: str, slot: str, configure=None):
    """``model``'s layers in a new ``cls`` (``configure(obj)`` runs before the layers are added), or the one kept
    in ``model.__dict__[slot]`` for ``level`` if nothing changed since."""
    layers = model.layers
    key = (level,) + tuple(id(x) for layer in layers for x in (layer.wqkv, layer.wo, layer.w13, layer.w2)) + (
        id(model.norm),)
    held = model.__dict__.setdefault(slot, {})
    found = held.get(level)
    if found is not None and found[0] == key:
        return found[1]
    c = model.config
    obj = cls(c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, float(c.rms_norm_eps),
              float(model.scale), _f32(model.norm))
    if configure is not None:
        configure(obj)
    for layer in layers:
        obj.add_layer(layer.wqkv.native(level), _f32(layer.bqkv), layer.wo.native(level), _f32(layer.bo),
                      layer.w13.native(level), layer.w2.native(level), _f32(layer.input_norm), _f32(layer.post_norm))
    held[level] = (key, obj)
    return obj
