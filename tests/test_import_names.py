"""Our numerics and schema packages install under import names that no other project uses, so that they live
beside SGLang, which depends on PyPI's ``kernels`` (``from kernels import get_kernel``)."""

from __future__ import annotations

import subprocess
import sys


def test_pypi_kernels_and_ours_in_one_interpreter(tmp_path):
    # run outside the repository: its folders kernels/ and schemas/ would otherwise shadow site-packages
    code = (
        "import kernels, tracefp4, traceschemas, tracestore, tracerl\n"
        "from kernels import get_kernel, load_kernel\n"
        "assert 'site-packages' in kernels.__file__ or 'dist-packages' in kernels.__file__, kernels.__file__\n"
        "assert callable(get_kernel) and callable(load_kernel)\n"
        "assert hasattr(tracefp4, 'quantize') and not hasattr(kernels, 'quantize')\n"
        "assert traceschemas.FORMAT_VERSION in traceschemas.SUPPORTED_FORMAT_VERSIONS\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
