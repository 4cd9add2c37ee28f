//! A real c10d TCPStore server, hosted by the venv's Python (torch), that a test questions
//! line by line: the launcher's store client (`src/store.rs`'s tests include this file) and
//! the launcher's reports of its ranks' exits (`tests/launcher.rs`). Every wait is bounded,
//! and dropping the server ends its process.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

/// The server: a TCPStore master on the port given as its argument (0: a port of its
/// choosing, with no race for a free one), then one answer line per question line on stdin, through PyTorch's own client
/// (so keys go through its "/" prefix, as the ranks' reads do):
///
/// - `set KEY VALUE`: sets KEY (VALUE: words without newlines), answers `ok`;
/// - `get KEY`: the value as text, or `<missing>`;
/// - `add KEY`: `store.add(KEY, 0)`, the counter's value;
/// - `wait KEY`: `ok` once KEY is set (at most 30 s), else the error.
///
/// It exits at the end of stdin (the test and its pipe are gone) and after 120 s at most.
const SERVER: &str = r#"
import datetime, signal, sys
import torch.distributed as dist
signal.alarm(120)
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
print(store.port, flush=True)
for line in sys.stdin:
    op, key, *value = line.split()
    try:
        if op == "set":
            store.set(key, " ".join(value))
            answer = "ok"
        elif op == "get":
            answer = store.get(key).decode() if store.check([key]) else "<missing>"
        elif op == "add":
            answer = store.add(key, 0)
        elif op == "wait":
            store.wait([key], datetime.timedelta(seconds=30))
            answer = "ok"
        else:
            answer = f"unknown question {op}"
    except Exception as e:
        answer = f"error: {e!r}".replace("\n", " ")
    print(answer, flush=True)
"#;

/// How long the server may take to start (importing torch) or to answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// The venv's Python, which `make setup` creates with torch in it.
fn venv_python() -> PathBuf {
    let python = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run `make setup` to create the venv with torch (these tests need a \
         real TCPStore server)",
        python.display()
    );
    python
}

/// A running TCPStore server; see [`SERVER`].
pub struct TcpStoreServer {
    child: Child,
    stdin: Option<ChildStdin>,
    answers: Receiver<String>,
    port: u16,
}

impl TcpStoreServer {
    /// Starts the server on a port of its choosing and waits (bounded) until it listens.
    pub fn start() -> TcpStoreServer {
        Self::start_at(0)
    }

    /// Starts the server on `port` (0: one of its choosing) and waits (bounded) until it
    /// listens.
    pub fn start_at(port: u16) -> TcpStoreServer {
        let mut child = Command::new(venv_python())
            .args(["-c", SERVER, &port.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting the venv's Python");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        // Lines come through a thread, so that every wait for one has a timeout.
        let (line_tx, answers) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = TcpStoreServer {
            child,
            stdin,
            answers,
            port: 0,
        };
        let first = server.next_line("its port");
        server.port = first
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("the store server printed {first:?}, not its port"));
        server
    }

    /// The port the store listens on, at 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `key`'s value through PyTorch's client, or `<missing>`.
    pub fn get(&mut self, key: &str) -> String {
        self.ask("get", key)
    }

    /// Sets `key` to `value` (words without newlines) through PyTorch's client.
    pub fn set(&mut self, key: &str, value: &str) {
        assert_eq!(
            self.ask("set", &format!("{key} {value}")),
            "ok",
            "setting {key}"
        );
    }

    /// The counter `key` through PyTorch's client (`store.add(key, 0)`).
    pub fn count(&mut self, key: &str) -> i64 {
        let answer = self.ask("add", key);
        answer
            .parse()
            .unwrap_or_else(|_| panic!("add {key} answered {answer:?}"))
    }

    /// Waits (at most 30 s) until `key` is set; panics otherwise.
    pub fn wait(&mut self, key: &str) {
        assert_eq!(self.ask("wait", key), "ok", "waiting for {key}");
    }

    fn ask(&mut self, op: &str, key: &str) -> String {
        let stdin = self.stdin.as_mut().expect("stdin open until drop");
        writeln!(stdin, "{op} {key}").expect("writing to the store server");
        self.next_line(&format!("an answer to {op} {key}"))
    }

    fn next_line(&mut self, what: &str) -> String {
        match self.answers.recv_timeout(ANSWER_TIMEOUT) {
            Ok(line) => line,
            Err(e) => {
                let _ = self.child.kill();
                panic!(
                    "the store server gave no {what} within {} s ({e})",
                    ANSWER_TIMEOUT.as_secs()
                )
            }
        }
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        // The end of stdin ends the server; it gets 5 s for that, then SIGKILL.
        drop(self.stdin.take());
        for _ in 0..250 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
