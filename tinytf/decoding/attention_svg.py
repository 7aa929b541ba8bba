"""Encoder-decoder attention of one translation as an SVG heat map (the paper's figures 3-5).

    weights = cross_attention_weights(model, src_ids, hyp_tokens)  # (layers, h, T, S)
    svg = attention_svg(weights[-1].mean(axis=0), src_pieces, tgt_pieces)

The SVG is written by hand (a few rectangles and labels), so no plotting library is needed.
Rows are target positions (each piece and the final ``</s>``), columns source positions (each
piece and ``</s>``); a cell's darkness is its attention weight relative to the largest weight
in the picture (white 0, black the maximum); hovering a cell shows the weight itself.
"""

from __future__ import annotations

import numpy as np

from tinytf.engine.backend import to_numpy
from tinytf.engine.tensor import no_grad
from tinytf.models.transformer import causal_mask, padding_mask
from tinytf.nn import functional as F
from tinytf.text import BOS_ID, EOS_ID


def cross_attention_weights(model, src_ids, tgt_ids) -> np.ndarray:
    """Encoder-decoder attention weights of every layer, (n_layers, h, T, S) float32.

    ``src_ids`` are the source ids including the final ``</s>`` (S of them), ``tgt_ids`` the
    output tokens without ``<s>``/``</s>``. The decoder reads ``<s> tgt_ids`` (teacher forcing,
    T = len(tgt_ids) + 1 positions); row t is where it looks while predicting token t (the last
    row predicts ``</s>``). Mirrors ``DecoderLayer.forward`` to reach the weights inside it.
    """
    xp = np
    src = xp.asarray(src_ids, dtype=np.int64)[None]                  # (1, S)
    tgt_in = xp.asarray([BOS_ID, *tgt_ids], dtype=np.int64)[None]     # (1, T)
    src_mask, tgt_mask = padding_mask(src), causal_mask(tgt_in.shape[1])
    weights = []
    with no_grad():
        memory = model.encode(src)
        x = model.pos(model.embed(tgt_in))                            # (1, T, d)
        for layer in model.decoder.layers:
            memory_kv = layer.cross_attn.project_kv(memory)
            # The query input of the cross-attention sub-layer (see SublayerConnection).
            y = layer.sub1(x, lambda z: layer.self_attn(z, tgt_mask))
            query_in = layer.sub2.norm(y) if layer.sub2.pre_norm else y
            q = layer.cross_attn.cross_queries(query_in)
            _, w = F.attention(q, *memory_kv, mask=src_mask, return_weights=True)
            weights.append(to_numpy(w)[0])                            # (h, T, S)
            x = layer(x, memory_kv, src_mask, tgt_mask)
    return np.stack(weights).astype(np.float32)


def _escape(text: str) -> str:
    """XML text: escape markup, and show characters XML 1.0 forbids as ``\\xNN``."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = text.replace('"', "&quot;")
    return "".join(c if c >= " " or c in "\t" else f"\\x{ord(c):02x}" for c in text)


def attention_svg(weights, src_labels, tgt_labels, cell: int = 18, title: str = "") -> str:
    """An SVG document showing ``weights`` (T, S) with row labels ``tgt_labels`` (T of them) and
    column labels ``src_labels`` (S of them), written vertically above the grid."""
    weights = np.asarray(weights, dtype=np.float32)
    rows, cols = weights.shape
    if (len(tgt_labels), len(src_labels)) != (rows, cols):
        raise ValueError(f"attention_svg: weights are {rows}x{cols} but there are "
                         f"{len(tgt_labels)} row and {len(src_labels)} column labels")
    char = 7  # approximate width of one label character at font-size 11
    left = 10 + char * max([len(s) for s in tgt_labels] + [1])
    top = 10 + char * max([len(s) for s in src_labels] + [1]) + (20 if title else 0)
    width, height = left + cols * cell + 10, top + rows * cell + 10
    top_weight = max(float(weights.max(initial=0.0)), 1e-9)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    if title:
        out.append(f'<text x="10" y="16">{_escape(title)}</text>')
    for j, label in enumerate(src_labels):
        x, y = left + j * cell + cell * 0.7, top - 5
        out.append(f'<text x="{x:.1f}" y="{y}" transform="rotate(-90 {x:.1f} {y})">'
                   f'{_escape(label)}</text>')
    for i, label in enumerate(tgt_labels):
        out.append(f'<text x="{left - 5}" y="{top + i * cell + cell * 0.7:.1f}" '
                   f'text-anchor="end">{_escape(label)}</text>')
        for j in range(cols):
            level = int(round(255 * (1.0 - min(max(float(weights[i, j]), 0.0) / top_weight,
                                               1.0))))
            out.append(f'<rect x="{left + j * cell}" y="{top + i * cell}" width="{cell}" '
                       f'height="{cell}" fill="rgb({level},{level},{level})">'
                       f'<title>{weights[i, j]:.3f}</title></rect>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def translation_attention_svg(model, bpe, src_ids, tgt_ids, title: str = "") -> str:
    """The SVG of one translation: last decoder layer, averaged over heads.

    ``src_ids`` without ``</s>`` (it is added), ``tgt_ids`` without ``<s>``/``</s>``.
    """
    src = [*src_ids, EOS_ID]
    weights = cross_attention_weights(model, src, tgt_ids)[-1].mean(axis=0)   # (T, S)
    pieces = bpe.id_to_piece
    return attention_svg(weights, [pieces(i) for i in src],
                         [pieces(i) for i in [*tgt_ids, EOS_ID]], title=title)
