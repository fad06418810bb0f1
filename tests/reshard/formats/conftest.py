import pytest


@pytest.fixture(params=["float32", "bfloat16"])
def dtype(request):
    return request.param
