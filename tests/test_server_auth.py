"""API and admin keys, TLS and CORS of `exlpy serve` (demo model; in-process TestClient, and a real uvicorn with a
self-signed certificate for TLS)."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from exlpy.cli.main import build_parser, main  # noqa: E402
from exlpy.cli.serve import options_from_args  # noqa: E402
from exlpy.errors import ConfigError  # noqa: E402
from exlpy.runtime import RuntimeOptions, use_options  # noqa: E402
from exlpy.server import auth, create_app  # noqa: E402
from exlpy.server.options import AccessOptions, ServeOptions, access_options, model_options  # noqa: E402
from tests.openai_server import free_port  # noqa: E402
from tests.test_server_helpers import make_state, single_torch_thread  # noqa: E402, F401  (autouse fixture)

BODY = {"prompt": "Once", "max_tokens": 2, "temperature": 0}


def keyed_client(**access: Any) -> TestClient:
    state = make_state(pages=2)
    state.access = AccessOptions(**access)
    return TestClient(create_app(state))


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert err["type"] == "invalid_request_error" and r.headers["www-authenticate"] == "Bearer"


def test_api_keys_guard_every_route_but_health() -> None:
    with keyed_client(api_keys=("key-one", "key-two")) as c:
        assert_401(c.post("/v1/completions", json=BODY))
        assert "didn't provide" in c.post("/v1/completions", json=BODY).json()["error"]["message"]
        wrong = c.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer key-on"})
        assert_401(wrong)
        assert "Incorrect API key" in wrong.json()["error"]["message"]
        assert_401(c.post("/v1/completions", json=BODY, headers={"Authorization": "Basic key-one"}))
        assert_401(c.get("/v1/models", headers={"x-api-key": "KEY-ONE"}))
        assert c.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer key-one"}).status_code == 200
        assert c.post("/v1/completions", json=BODY, headers={"x-api-key": "key-two"}).status_code == 200
        assert c.get("/v1/models", headers={"authorization": "bearer key-two"}).status_code == 200
        # Unknown routes do not tell a keyless caller what exists; /health stays open.
        assert_401(c.get("/v1/nothing"))
        assert c.get("/health").status_code == 200
        assert c.post("/tokenize", json={"prompt": "a"}).status_code == 401
        # /metrics is open by default (no such route in this app: 404, not 401).
        assert c.get("/metrics").status_code == 404
    with keyed_client(api_keys=("k",), metrics_require_key=True) as c:
        assert_401(c.get("/metrics"))
        assert c.get("/health").status_code == 200


def test_no_keys_keeps_the_server_open() -> None:
    with keyed_client() as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200


def test_admin_routes_need_an_admin_key() -> None:
    with keyed_client(api_keys=("user",)) as c:  # no admin key: admin routes are disabled
        r = c.post("/v1/model/unload", headers={"Authorization": "Bearer user"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
    with keyed_client(api_keys=("user",), admin_keys=("boss",)) as c:
        assert_401(c.post("/v1/lora/unload"))
        assert_401(c.post("/v1/lora/unload", headers={"x-admin-key": "bos"}))
        r = c.post("/v1/lora/unload", headers={"Authorization": "Bearer user"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_permissions"
        ok = c.post("/v1/lora/unload", headers={"x-admin-key": "boss"})
        assert ok.status_code == 200 and ok.json() == {"unloaded": []}
        # An admin key is accepted on user routes too; GET /v1/model is a user route.
        assert c.get("/v1/model", headers={"Authorization": "Bearer boss"}).json()["id"] == "aidreams260K"
        assert_401(c.get("/v1/model"))
        # A trailing slash or doubled slashes do not dodge the admin check.
        assert c.post("/v1/lora/unload/", headers={"Authorization": "Bearer user"}).status_code in (401, 403)
    with keyed_client(disable_auth=True, api_keys=("user",)) as c:  # TabbyAPI's disable_auth: all open
        assert c.post("/v1/lora/unload").status_code == 200
        assert c.post("/v1/completions", json=BODY).status_code == 200


def test_keys_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    policy = auth.KeyPolicy(api_keys=["first", "second", "third"])
    assert policy.refusal("/v1/completions", {b"authorization": b"Bearer first"}) is None
    # Every configured key was compared although the first one matched: the time does not tell which key.
    assert [b for _, b in calls] == [b"first", b"second", b"third"]
    calls.clear()
    assert policy.refusal("/v1/completions", {b"x-api-key": b"nope"})[0] == 401
    assert len(calls) == 3


def test_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = tmp_path / "keys.txt"
    lines.write_text("# team keys\nalpha\n\nbeta\n")
    tabby = tmp_path / "api_tokens.yml"
    tabby.write_text("api_key: gamma\nadmin_key: delta\n")
    args = build_parser().parse_args(["serve", "--api-key", "one", "--api-key", "two", "--api-key-file", str(lines),
                                      "--api-key-file", str(tabby), "--admin-key", "root"])
    with use_options(RuntimeOptions.from_env({"EXLPY_API_KEY": "from-env"})):
        opts, _ = options_from_args(args)
    assert opts.access.api_keys == ("one", "two", "alpha", "beta", "gamma", "from-env")
    assert opts.access.admin_keys == ("root", "delta")
    assert "from-env" not in repr(opts) and "from-env" not in repr(RuntimeOptions.from_env({"EXLPY_API_KEY": "x"}))
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing\n")
    for bad, match in ((["--api-key-file", str(empty)], "holds no key"),
                       (["--api-key-file", str(tmp_path / "none")], "cannot be read"),
                       (["--api-key", " spaced "], "surrounding spaces"), (["--api-key", ""], "non-empty")):
        with pytest.raises(ConfigError, match=match):
            options_from_args(build_parser().parse_args(["serve", *bad]))


def test_cors_only_for_allowed_origins() -> None:
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    with keyed_client(api_keys=("k",)) as c:  # no origins: no CORS headers (browsers refuse)
        assert "access-control-allow-origin" not in c.options("/v1/completions", headers=pre).headers
    with keyed_client(api_keys=("k",), allowed_origins=("https://app.example",)) as c:
        r = c.options("/v1/completions", headers=pre)  # the preflight carries no key and must pass
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = c.post("/v1/completions", json=BODY, headers={"Origin": "https://app.example", "x-api-key": "k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        other = c.options("/v1/completions", headers={**pre, "Origin": "https://evil.example"})
        assert other.headers.get("access-control-allow-origin") != "https://evil.example"
    args = build_parser().parse_args(["serve", "--allowed-origins", "https://a.example, https://b.example"])
    assert options_from_args(args)[0].access.allowed_origins == ("https://a.example", "https://b.example")


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    try:
        from cryptography import x509  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is available to make a certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        return key, cert
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    pk = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(pk.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now)
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
         .sign(pk, hashes.SHA256()))
    key.write_bytes(pk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    return key, cert


@contextmanager
def running(opts: ServeOptions, state: Any) -> Iterator[str]:
    from exlpy.server.run import make_server

    server = make_server(create_app(state), state, opts)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        assert time.monotonic() - t0 < 30 and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"{'https' if opts.access.tls else 'http'}://127.0.0.1:{opts.access.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_tls(tmp_path: Path) -> None:
    key, cert = _self_signed(tmp_path)
    access = access_options({"ssl_keyfile": str(key), "ssl_certfile": str(cert), "port": free_port(),
                             "api_key": ["secret"]}, None)
    opts = ServeOptions(access=access, model=model_options({}), log_level="warning")
    state = make_state(pages=2)
    state.access = access
    trust = ssl.create_default_context(cafile=str(cert))
    with running(opts, state) as base:
        assert base.startswith("https://")
        r = httpx.post(f"{base}/v1/completions", json=BODY, headers={"Authorization": "Bearer secret"},
                       verify=trust, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        assert httpx.get(f"{base}/v1/models", verify=trust, timeout=30).status_code == 401
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
            httpx.get(base.replace("https://", "http://") + "/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # the certificate is not trusted unless the client says so
            httpx.get(f"{base}/health", timeout=5)


def test_tls_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    assert main(["serve", "--ssl-certfile", str(cert)]) == 1
    assert "--ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err
    assert main(["serve", "--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "nope.pem")]) == 1
    assert "nope.pem: no such file" in capsys.readouterr().err


def test_openai_client_sends_the_key() -> None:
    openai = pytest.importorskip("openai")
    access = access_options({"port": free_port(), "api_key": ["sk-team"]}, None)
    opts = ServeOptions(access=access, model=model_options({}), log_level="warning")
    state = make_state(pages=2)
    state.access = replace(access)
    with running(opts, state) as base:
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-team", max_retries=0)
        assert good.completions.create(model="aidreams260K", prompt="Once", max_tokens=2).choices[0].text
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-other", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
