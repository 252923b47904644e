"""Image preprocessing against hand-computed values; postprocessing against plain numpy."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from servekit import InvalidInput, Postprocess, Preprocess
from servekit.stages import IMAGENET_MEAN, IMAGENET_STD, softmax, synthetic_image, top_k
from servekit.stages.image import fit


def encode(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def normalise_by_hand(value: int, channel: int) -> float:
    return (value / 255.0 - IMAGENET_MEAN[channel]) / IMAGENET_STD[channel]


@pytest.fixture(scope="module")
def pre():
    with Preprocess(workers=2) as stage:
        yield stage


def test_a_256_square_png_is_only_centre_cropped_and_normalised(pre):
    # 256x256 needs no resize, so every output pixel is a known input pixel.
    yy, xx = np.mgrid[0:256, 0:256]
    pixels = np.stack([xx, yy, (xx + 2 * yy) % 256], axis=-1).astype(np.uint8)
    out = pre.images([encode(pixels)])
    assert out.shape == (1, 3, 224, 224) and out.dtype == np.float32
    for c, y, x in [(0, 0, 0), (1, 0, 0), (2, 10, 200), (0, 223, 223), (1, 100, 7)]:
        expected = normalise_by_hand(int(pixels[16 + y, 16 + x, c]), c)
        assert out[0, c, y, x] == pytest.approx(expected, abs=1e-5)


def test_a_constant_colour_survives_resize_and_crop_of_any_aspect(pre):
    colour = (10, 128, 250)
    wide = np.empty((300, 512, 3), np.uint8)
    wide[:] = colour
    tall = np.ascontiguousarray(wide.transpose(1, 0, 2))
    out = pre.images([encode(wide), encode(tall)])
    for c in range(3):
        np.testing.assert_allclose(out[:, c], normalise_by_hand(colour[c], c), atol=1e-5)


def test_grayscale_and_rgba_images_become_rgb(pre):
    gray = np.full((240, 320), 77, np.uint8)
    rgba = np.zeros((240, 320, 4), np.uint8)
    rgba[..., :3], rgba[..., 3] = 200, 255
    out = pre.images([encode(gray), encode(rgba)])
    np.testing.assert_allclose(out[0, 2], normalise_by_hand(77, 2), atol=1e-5)
    np.testing.assert_allclose(out[1, 0], normalise_by_hand(200, 0), atol=1e-5)


def test_the_crop_is_taken_from_the_centre_of_the_resized_image(pre):
    # A 256x400 image: no resize (short side 256), crop rows 16.. and columns 88..
    pixels = np.zeros((256, 400, 3), np.uint8)
    pixels[:, 88:312] = 255
    out = pre.images([encode(pixels)])
    np.testing.assert_allclose(out[0, 0], normalise_by_hand(255, 0), atol=1e-5)


def test_batched_output_equals_one_image_at_a_time(pre):
    images = [synthetic_image(i, size=(200 + 40 * i, 300)) for i in range(5)]
    batch = pre.images(images)
    for i, img in enumerate(images):
        np.testing.assert_array_equal(batch[i], pre.images([img])[0])


@pytest.mark.parametrize(
    ("blob", "why"),
    [
        (b"not an image at all", "not an image format Pillow can read"),
        (b"", "empty bytes"),
        (synthetic_image(0)[:200], "cannot decode image"),
    ],
)
def test_undecodable_bytes_are_invalid_input_naming_tensor_and_row(pre, blob, why):
    good = synthetic_image(1)
    with pytest.raises(InvalidInput, match="input 'image' row 1") as info:
        pre.images([good, blob])
    assert why in str(info.value)


def test_images_over_the_pixel_limit_are_rejected_before_decoding():
    small = Preprocess(max_pixels=1000, workers=1)
    with pytest.raises(InvalidInput, match="320x240 pixels exceeds the limit of 1000"):
        small.images([synthetic_image(0)])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 100_000), st.integers(1, 100_000), st.integers(16, 512))
def test_fit_refuses_exactly_the_images_that_would_pass_the_pixel_limit(w, h, resize):
    """Decoded or resized (shorter side to ``resize``), no image held passes the limit: an
    image that would is refused naming which; any other gets its shorter side ``resize``
    and a crop that lies inside it."""
    crop, limit = resize * 7 // 8, 4_000_000
    short, long = min(w, h), max(w, h)
    resized = resize * int(resize * long / short)
    try:
        width, height, left, top = fit(w, h, resize, crop, limit, "input 'image' row 3")
    except InvalidInput as exc:
        if w * h > limit:
            assert str(exc) == (
                f"input 'image' row 3: image of {w}x{h} pixels exceeds the limit of {limit} pixels"
            )
        else:
            assert resized > limit and "would resize to" in str(exc), str(exc)
        return
    assert w * h <= limit and resized <= limit
    assert min(width, height) == resize and width * height == resized
    assert 0 <= left <= width - crop and 0 <= top <= height - crop


def test_an_image_that_would_resize_past_the_limit_is_refused_before_any_pixel(pre):
    """30000x2: 60,000 pixels decoded, but 3,840,000x256 once its shorter side is 256."""
    out = io.BytesIO()
    Image.new("RGB", (30_000, 2), (1, 2, 3)).save(out, "PNG")
    with pytest.raises(InvalidInput, match=r"row 1: image of 30000x2 pixels would resize to "
                       r"3840000x256, over the limit of 64000000 pixels"):  # fmt: skip
        pre.images([synthetic_image(0), out.getvalue()])


def png_header(width: int, height: int) -> bytes:
    """A PNG's signature, header chunk and an empty data chunk: all Pillow reads to size
    an image (its pixels are never asked for)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"")


def test_an_image_past_pillows_own_limit_is_refused_with_its_size(pre):
    """Pillow refuses images over twice ``MAX_IMAGE_PIXELS`` as it opens them, before our
    limit is asked: the refusal still names the row, the size and our limit."""
    with pytest.raises(InvalidInput, match=r"^input 'image' row 1: image of 400000000 pixels "
                       r"exceeds the limit of 64000000 pixels \(Pillow refuses over \d+\)$"):  # fmt: skip
        pre.images([synthetic_image(0), png_header(20_000, 20_000)])


def test_preprocess_signature_is_triton_style_bytes(pre):
    assert pre.spec.inputs[0].dtype.triton == "TYPE_STRING"
    assert pre.spec.inputs[0].shape == (1,)
    with pytest.raises(InvalidInput, match="expected dtype BYTES, got FP32"):
        pre.infer({"image": np.zeros((1, 1), np.float32)})


@given(st.integers(1, 6), st.integers(1, 20), st.integers(0, 2**31))
def test_top_k_matches_a_full_stable_sort(rows, k, seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 5, (rows, 20)).astype(np.float32)  # many ties
    expected = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(top_k(scores, k), expected)


def test_softmax_is_stable_and_sums_to_one():
    p = softmax(np.array([[1000.0, 1000.0, -1000.0], [0.0, 1.0, 2.0]], np.float32))
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(p[0], [0.5, 0.5, 0.0], atol=1e-6)


def test_postprocess_returns_scores_classes_and_labels(tmp_path):
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(f"thing {i}" for i in range(10)))
    post = Postprocess(num_classes=10, top_k=3, labels=labels)
    logits = np.zeros((2, 10), np.float32)
    logits[0, [7, 2, 5]] = [3.0, 2.0, 1.0]
    logits[1, 9] = 5.0
    out = post.infer({"logits": logits})
    assert out["classes"][0].tolist() == [7, 2, 5]
    assert out["classes"][1, 0] == 9
    assert out["labels"][0].tolist() == [b"thing 7", b"thing 2", b"thing 5"]
    np.testing.assert_allclose(
        out["scores"], np.take_along_axis(softmax(logits.copy()), out["classes"], 1)
    )


def test_postprocess_rejects_bad_configuration():
    with pytest.raises(ValueError, match="expected 10 labels, got 2"):
        Postprocess(num_classes=10, labels=["a", "b"])
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 10\], got 11"):
        Postprocess(num_classes=10, top_k=11)
