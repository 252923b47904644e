"""The numpy add_sub as an MLServer MLModel (bench/user_code.py writes its settings):
MLServer's own codec, adaptive batching from model-settings.json."""

from __future__ import annotations

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class AddSub(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        inputs = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        a, b = inputs["INPUT0"], inputs["INPUT1"]
        return InferenceResponse(
            model_name=self.name,
            outputs=[
                NumpyCodec.encode_output("OUTPUT0", a + b),
                NumpyCodec.encode_output("OUTPUT1", a - b),
            ],
        )
