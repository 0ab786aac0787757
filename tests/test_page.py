"""The chat page `serve` answers at / (`jaxinfer/web/index.html`), in a real headless Chromium driven
by Selenium (the distribution's chromium and chromedriver: nothing downloaded): it lists the
models, streams a reply equal to the API's (greedy), keeps the conversation, stops a reply when
asked, and never lets HTML a model writes into the page. Skipped, saying why, where no browser is
installed (CI installs none)."""

import json
import shutil
import time

import httpx
import pytest
from test_server import WAIT_S, Served

pytestmark = pytest.mark.slow
BROWSER, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
if not (BROWSER and DRIVER):
    pytest.skip("no chromium and chromedriver (apt install chromium chromium-driver)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")


@pytest.fixture(scope="module")
def served():
    server = Served("-b", "2", "-c", "256")
    yield server
    server.stop()
    assert "Traceback" not in "".join(server.stderr)


@pytest.fixture(scope="module")
def page(served):
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(DRIVER), options=options)
    browser.get(served.url + "/")
    yield browser
    browser.quit()


def until(condition, timeout: float = WAIT_S):
    """Waits for an event the page shows (never a fixed time)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "the page did not get there"
        time.sleep(0.05)
    return value


def conversations(page) -> list:
    return json.loads(page.execute_script("return localStorage.getItem('jaxinfer.conversations')") or "[]")


def ask(page, text: str) -> None:
    from selenium.webdriver.common.by import By

    page.find_element(By.ID, "input").send_keys(text)
    page.find_element(By.ID, "send").click()


def test_a_reply_streams_as_the_api_answers_and_is_kept(page, served):
    from selenium.webdriver.common.by import By

    model = until(lambda: page.execute_script("return document.getElementById('model').value"))
    assert model == httpx.get(served.url + "/v1/models", timeout=WAIT_S).json()["data"][0]["id"]
    for field, value in (("temperature", "0"), ("max_tokens", "24")):
        box = page.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    ask(page, "The capital of France")
    until(lambda: not page.find_element(By.ID, "send").get_attribute("hidden"))  # the reply ended
    said = conversations(page)[0]["messages"]
    body = {"messages": [{"role": "user", "content": "The capital of France"}], "temperature": 0, "max_tokens": 24}
    answer = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=WAIT_S).json()
    assert [m["role"] for m in said] == ["user", "assistant"]
    assert said[1]["content"] == answer["choices"][0]["message"]["content"] != ""
    page.refresh()  # kept in the browser: the conversation is there again
    until(lambda: len(page.find_elements(By.CSS_SELECTOR, ".message")) == 2)
    assert page.find_element(By.CSS_SELECTOR, ".conversation").text.startswith("The capital of France")


def test_stop_keeps_what_came(page):
    from selenium.webdriver.common.by import By

    page.find_element(By.ID, "new").click()
    box = page.find_element(By.ID, "max_tokens")
    box.clear()
    box.send_keys("200")
    ask(page, "Once upon a time")
    until(lambda: page.execute_script("return document.querySelectorAll('.answer')[0]?.textContent.length > 0"))
    page.find_element(By.ID, "stop").click()
    until(lambda: not page.find_element(By.ID, "send").get_attribute("hidden"))
    kept = conversations(page)[0]["messages"]
    assert kept[0]["content"] == "Once upon a time" and kept[1]["role"] == "assistant" and kept[1]["content"]


def test_html_a_model_writes_never_reaches_the_page(page):
    """A reply streamed by a stand-in for the server (the page's fetch replaced): its markup shown as
    text, its markdown rendered, a javascript: link left a link of no kind."""
    from selenium.webdriver.common.by import By

    said = '<img src=x onerror="window.pwned=1"> **bold** `code` [x](javascript:window.pwned=2)\n```\n<b>hi</b>\n```'
    chunk = json.dumps({"choices": [{"delta": {"content": said}}]})
    page.execute_script(
        """const body = arguments[0];
        window.fetch = async () => new Response(new Blob([body]), {status: 200});""",
        f"data: {chunk}\n\ndata: [DONE]\n\n",
    )
    page.find_element(By.ID, "new").click()
    ask(page, "show me")
    answer = until(lambda: page.find_elements(By.CSS_SELECTOR, ".message.assistant .answer"))[-1]
    until(lambda: "bold" in answer.get_attribute("innerHTML"))
    html = answer.get_attribute("innerHTML")
    assert page.execute_script("return window.pwned") is None
    assert not answer.find_elements(By.TAG_NAME, "img") and not answer.find_elements(By.TAG_NAME, "a")
    assert "&lt;img" in html and "<strong>bold</strong>" in html and "<code>code</code>" in html
    assert "&lt;b&gt;hi&lt;/b&gt;" in answer.find_element(By.TAG_NAME, "pre").get_attribute("innerHTML")


def test_reasoning_shows_dim_then_folds_when_the_answer_starts(page):
    from selenium.webdriver.common.by import By

    chunks = [
        {"reasoning_content": "Paris is the capital"},
        {"reasoning_content": " of France."},
        {"content": "Paris."},
    ]
    stream = "".join(f"data: {json.dumps({'choices': [{'delta': c}]})}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.execute_script(
        "const body = arguments[0]; window.fetch = async () => new Response(new Blob([body]), {status: 200});", stream
    )
    page.find_element(By.ID, "new").click()
    ask(page, "Capital of France?")
    until(lambda: not page.find_element(By.ID, "send").get_attribute("hidden"))
    reply = page.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]
    folded = reply.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert (
        folded.get_attribute("open") is None and folded.find_element(By.TAG_NAME, "summary").text == "thought (6 words)"
    )
    assert reply.find_element(By.CSS_SELECTOR, ".answer").text == "Paris."
    assert conversations(page)[0]["messages"][1] == {
        "role": "assistant",
        "content": "Paris.",
        "reasoning": "Paris is the capital of France.",
    }
