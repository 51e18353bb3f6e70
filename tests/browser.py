"""A real headless Chromium (Debian's ``chromium`` and ``chromium-driver``) driven by Selenium,
and the console as a real process, for the console's end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

from keyq.broker.settings import Settings
from tests.servers import free_port
from tests.workers import LoggedProcess, keyq_environment, wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MISSING = (
    "chromium and chromedriver are not installed: they are Debian's `chromium` and "
    "`chromium-driver` packages, which scripts/services.sh installs as root"
)


def need_chromium() -> tuple[str, str]:
    """The browser and its driver; in CI their absence fails, elsewhere it skips."""
    browser = shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)
    driver = shutil.which("chromedriver") or (CHROMEDRIVER if Path(CHROMEDRIVER).exists() else None)
    if browser is None or driver is None:
        if os.environ.get("CI"):
            pytest.fail(MISSING)
        pytest.skip(MISSING)
    return browser, driver


@contextmanager
def chromium() -> Iterator[object]:
    """A headless Chromium with a window big enough for the console's screenshots."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = need_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in (
        "--headless=new",
        "--no-sandbox",  # root in a container has no user namespace for the sandbox
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(argument)
    session = webdriver.Chrome(options=options, service=Service(driver))
    session.set_page_load_timeout(30)
    try:
        yield session
    finally:
        session.quit()


def screenshot(session: object, path: Path) -> None:
    """The whole page, not just the window: the window is grown to the page's height."""
    height = session.execute_script("return document.documentElement.scrollHeight")  # type: ignore[attr-defined]
    session.set_window_size(1280, min(max(int(height) + 40, 600), 2400))  # type: ignore[attr-defined]
    path.parent.mkdir(parents=True, exist_ok=True)
    session.save_screenshot(str(path))  # type: ignore[attr-defined]
    session.set_window_size(1280, 900)  # type: ignore[attr-defined]


class ConsoleProcess(LoggedProcess):
    """``keyq console`` on a free loopback port, its log in a file."""

    def __init__(
        self, settings: Settings, log_dir: Path, *args: str, env: Mapping[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = ["console", "--port", str(self.port), *args]
        super().__init__(
            log_dir / f"console-{self.port}.log", command, keyq_environment(settings, env)
        )

        def healthy() -> bool:
            if self.process.poll() is not None:
                raise AssertionError("the console exited")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as answer,
            ):
                return bool(answer.status == 200)
            return False

        try:
            wait_until(healthy, 30, "the console to start", every=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self.log()[-2000:]}") from None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
