//! The rendezvous' messages on the wire: one line of text each way per connection, at most
//! [`MAX_LINE`] bytes, `tdrdzv1 VERB key=value ...\n`, values percent-escaped (every byte
//! outside `!`..`~`, and `%`). Decoding is total: anything else is an error value naming what
//! was wrong, never a panic, and never an allocation larger than the line.

use std::collections::BTreeMap;
use std::time::Duration;

use super::round::{Assignment, CloseWhy, Closure, Member, NodeId, Reply, Request};

/// The first word of every line: the protocol and its version.
pub const MAGIC: &str = "tdrdzv1";

/// The longest line either side sends or reads, newline included.
pub const MAX_LINE: usize = 4096;

/// The longest free text (a failure, a reason) sent, in bytes before escaping: with every
/// other field bounded too (an address at most [`MAX_ADDR`]), every line fits [`MAX_LINE`].
pub const MAX_TEXT: usize = 1000;

/// The longest node address taken (a DNS name is at most 253 bytes).
pub const MAX_ADDR: usize = 255;

/// `s` cut to at most [`MAX_TEXT`] bytes, at a character boundary.
pub fn clip(s: &str) -> &str {
    let mut end = s.len().min(MAX_TEXT);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A request with the run it is for (a launcher of another job must be refused, not served).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub run_id: String,
    pub request: Request,
}

/// `bytes` escaped for a value.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if (b'!'..=b'~').contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn unescape(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("a bad escape in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} is not UTF-8 once unescaped"))
}

/// A line being built.
struct Line(String);

impl Line {
    fn new(verb: &str) -> Line {
        Line(format!("{MAGIC} {verb}"))
    }
    fn with(mut self, key: &str, value: impl ToString) -> Line {
        self.0.push(' ');
        self.0.push_str(key);
        self.0.push('=');
        self.0.push_str(&escape(&value.to_string()));
        self
    }
    fn node(self, id: &NodeId) -> Line {
        self.with("addr", &id.addr)
            .with("pid", id.pid)
            .with("token", id.token)
    }
    /// A free text, clipped to [`MAX_TEXT`].
    fn text(self, key: &str, value: &str) -> Line {
        self.with(key, clip(value))
    }
    /// The line. Only a run id far longer than any in use could make it longer than
    /// [`MAX_LINE`]; the other side then refuses it as too long.
    fn done(mut self) -> String {
        self.0.push('\n');
        self.0
    }
}

/// A line read: its verb and fields.
struct Fields {
    verb: String,
    fields: BTreeMap<String, String>,
}

impl Fields {
    fn parse(line: &str) -> Result<Fields, String> {
        let line = line.strip_suffix('\n').unwrap_or(line);
        let mut words = line.split(' ');
        if words.next() != Some(MAGIC) {
            return Err(format!(
                "not a rendezvous message (it does not start with {MAGIC})"
            ));
        }
        let verb = words
            .next()
            .filter(|v| !v.is_empty())
            .ok_or("a message without a verb")?
            .to_string();
        let mut fields = BTreeMap::new();
        for w in words {
            let (k, v) = w
                .split_once('=')
                .ok_or_else(|| format!("{w:?} is not key=value"))?;
            if fields.insert(k.to_string(), unescape(v)?).is_some() {
                return Err(format!("{k} is given twice"));
            }
        }
        Ok(Fields { verb, fields })
    }
    fn text(&self, key: &str) -> Result<String, String> {
        self.fields
            .get(key)
            .cloned()
            .ok_or_else(|| format!("{} without {key}", self.verb))
    }
    fn num<T: std::str::FromStr>(&self, key: &str) -> Result<T, String> {
        let v = self.text(key)?;
        v.parse()
            .map_err(|_| format!("{}'s {key} {v:?} is not a number", self.verb))
    }
    fn opt_num<T: std::str::FromStr>(&self, key: &str) -> Result<Option<T>, String> {
        match self.fields.get(key).map(String::as_str) {
            None | Some("none") => Ok(None),
            Some(_) => self.num(key).map(Some),
        }
    }
    fn node(&self) -> Result<NodeId, String> {
        let addr = self.text("addr")?;
        if addr.is_empty() || addr.len() > MAX_ADDR {
            return Err(format!("a node address of {} bytes", addr.len()));
        }
        Ok(NodeId {
            addr,
            pid: self.num("pid")?,
            token: self.num("token")?,
        })
    }
    fn pair(&self, key: &str, sep: char) -> Result<(u64, u64), String> {
        let v = self.text(key)?;
        let parsed = v
            .split_once(sep)
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
        parsed.ok_or_else(|| format!("{}'s {key} {v:?} is not two numbers", self.verb))
    }
    fn closure(&self) -> Result<Closure, String> {
        let why = match self.text("why")?.as_str() {
            "finished" => CloseWhy::Finished,
            "restarts" => CloseWhy::OutOfRestarts {
                restarts: self.num("restarts")?,
                failure: self.text("failure")?,
            },
            other => return Err(format!("an unknown closure {other:?}")),
        };
        Ok(Closure {
            round: self.num("round")?,
            by: self.node()?,
            group_rank: self.opt_num("group_rank")?,
            why,
        })
    }
}

fn close_fields(line: Line, why: &CloseWhy) -> Line {
    match why {
        CloseWhy::Finished => line.with("why", "finished"),
        CloseWhy::OutOfRestarts { restarts, failure } => line
            .with("why", "restarts")
            .with("restarts", restarts)
            .text("failure", failure),
    }
}

/// A request's line.
pub fn encode_request(e: &Envelope) -> String {
    let line = |verb: &str, id: &NodeId| Line::new(verb).with("run", &e.run_id).node(id);
    match &e.request {
        Request::Join { id, member, nnodes } => line("join", id)
            .with("nproc", member.nproc)
            .with("ports", format!("{},{}", member.ports[0], member.ports[1]))
            .with("nnodes", format!("{}:{}", nnodes.0, nnodes.1))
            .done(),
        Request::Poll { id } => line("poll", id).done(),
        Request::Close { id, why } => close_fields(line("close", id), why).done(),
        Request::Leave { id } => line("leave", id).done(),
    }
}

/// A request from its line.
pub fn decode_request(line: &str) -> Result<Envelope, String> {
    let f = Fields::parse(line)?;
    let run_id = f.text("run")?;
    let id = f.node()?;
    let request = match f.verb.as_str() {
        "join" => {
            let nproc: usize = f.num("nproc")?;
            if nproc == 0 {
                return Err("a join with no ranks".into());
            }
            let (p0, p1) = f.pair("ports", ',')?;
            let (lo, hi) = f.pair("nnodes", ':')?;
            let port = |p: u64| u16::try_from(p).map_err(|_| format!("port {p} is out of range"));
            let count = |n: u64| usize::try_from(n).map_err(|_| format!("{n} nodes"));
            Request::Join {
                id,
                member: Member {
                    nproc,
                    ports: [port(p0)?, port(p1)?],
                },
                nnodes: (count(lo)?, count(hi)?),
            }
        }
        "poll" => Request::Poll { id },
        "close" => Request::Close {
            id,
            why: match f.text("why")?.as_str() {
                "finished" => CloseWhy::Finished,
                "restarts" => CloseWhy::OutOfRestarts {
                    restarts: f.num("restarts")?,
                    failure: f.text("failure")?,
                },
                other => return Err(format!("an unknown closure {other:?}")),
            },
        },
        "leave" => Request::Leave { id },
        other => return Err(format!("an unknown request {other:?}")),
    };
    Ok(Envelope { run_id, request })
}

/// A reply's line.
pub fn encode_reply(r: &Reply) -> String {
    match r {
        Reply::Waiting {
            round,
            present,
            last_call_left,
        } => Line::new("waiting")
            .with("round", round)
            .with("present", present)
            .with(
                "last_call_ms",
                last_call_left.map_or("none".to_string(), |d| d.as_millis().to_string()),
            )
            .done(),
        Reply::Assigned(a) => Line::new("assigned")
            .with("round", a.round)
            .with("group_rank", a.group_rank)
            .with("group_world_size", a.group_world_size)
            .with("rank_base", a.rank_base)
            .with("world_size", a.world_size)
            .with("master_addr", &a.master_addr)
            .with("master_port", a.master_port)
            .done(),
        Reply::Restart { round, why } => Line::new("restart")
            .with("round", round)
            .text("why", why)
            .done(),
        Reply::Closed(c) => {
            let line = Line::new("closed").with("round", c.round).node(&c.by).with(
                "group_rank",
                c.group_rank.map_or("none".to_string(), |g| g.to_string()),
            );
            close_fields(line, &c.why).done()
        }
        Reply::Unknown { round } => Line::new("unknown").with("round", round).done(),
        Reply::Refused { why } => Line::new("refused").text("why", why).done(),
        Reply::Done => Line::new("done").done(),
    }
}

/// A reply from its line.
pub fn decode_reply(line: &str) -> Result<Reply, String> {
    let f = Fields::parse(line)?;
    Ok(match f.verb.as_str() {
        "waiting" => Reply::Waiting {
            round: f.num("round")?,
            present: f.num("present")?,
            last_call_left: f.opt_num("last_call_ms")?.map(Duration::from_millis),
        },
        "assigned" => Reply::Assigned(Assignment {
            round: f.num("round")?,
            group_rank: f.num("group_rank")?,
            group_world_size: f.num("group_world_size")?,
            rank_base: f.num("rank_base")?,
            world_size: f.num("world_size")?,
            master_addr: f.text("master_addr")?,
            master_port: f.num("master_port")?,
        }),
        "restart" => Reply::Restart {
            round: f.num("round")?,
            why: f.text("why")?,
        },
        "closed" => Reply::Closed(f.closure()?),
        "unknown" => Reply::Unknown {
            round: f.num("round")?,
        },
        "refused" => Reply::Refused {
            why: f.text("why")?,
        },
        "done" => Reply::Done,
        other => return Err(format!("an unknown reply {other:?}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> NodeId {
        NodeId {
            addr: "fe80::1%eth0".into(),
            pid: 42,
            token: u64::MAX,
        }
    }

    #[test]
    fn every_request_and_reply_comes_back_as_it_went() {
        let requests = [
            Request::Join {
                id: id(),
                member: Member {
                    nproc: 8,
                    ports: [1, 65535],
                },
                nnodes: (1, 4),
            },
            Request::Poll { id: id() },
            Request::Close {
                id: id(),
                why: CloseWhy::OutOfRestarts {
                    restarts: 3,
                    failure: "rank 2 exited with status 1\n100% = odd".into(),
                },
            },
            Request::Close {
                id: id(),
                why: CloseWhy::Finished,
            },
            Request::Leave { id: id() },
        ];
        for request in requests {
            let e = Envelope {
                run_id: "job with spaces".into(),
                request,
            };
            let line = encode_request(&e);
            assert!(
                line.ends_with('\n') && line.matches('\n').count() == 1,
                "{line}"
            );
            assert_eq!(decode_request(&line), Ok(e));
        }
        let replies = [
            Reply::Waiting {
                round: 3,
                present: 1,
                last_call_left: Some(Duration::from_millis(2500)),
            },
            Reply::Waiting {
                round: 0,
                present: 0,
                last_call_left: None,
            },
            Reply::Assigned(Assignment {
                round: 2,
                group_rank: 1,
                group_world_size: 3,
                rank_base: 4,
                world_size: 12,
                master_addr: "10.77.0.1".into(),
                master_port: 4242,
            }),
            Reply::Restart {
                round: 9,
                why: "node 1 left".into(),
            },
            Reply::Closed(Closure {
                round: 1,
                by: id(),
                group_rank: Some(0),
                why: CloseWhy::Finished,
            }),
            Reply::Closed(Closure {
                round: 1,
                by: id(),
                group_rank: None,
                why: CloseWhy::OutOfRestarts {
                    restarts: 0,
                    failure: String::new(),
                },
            }),
            Reply::Unknown { round: 5 },
            Reply::Refused {
                why: "another run".into(),
            },
            Reply::Done,
        ];
        for reply in replies {
            assert_eq!(decode_reply(&encode_reply(&reply)), Ok(reply));
        }
    }

    /// Whatever comes, decoding ends in a value: garbage, cut lines, huge numbers, bad
    /// escapes, duplicate keys.
    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let bad = [
            "",
            "\n",
            "GET / HTTP/1.1\r\n",
            "tdrdzv1",
            "tdrdzv1 \n",
            "tdrdzv1 poll",
            "tdrdzv1 poll run=a addr=b pid=-1 token=0",
            "tdrdzv1 poll run=a addr=b pid=99999999999 token=0",
            "tdrdzv1 poll run=a addr=b pid=1 token=0 pid=2",
            "tdrdzv1 poll run=%zz addr=b pid=1 token=0",
            "tdrdzv1 poll run=% addr=b pid=1 token=0",
            "tdrdzv1 poll run=%FF addr=b pid=1 token=0",
            "tdrdzv1 join run=a addr=b pid=1 token=0 nproc=0 ports=1,2 nnodes=1:1",
            "tdrdzv1 join run=a addr=b pid=1 token=0 nproc=1 ports=1,70000 nnodes=1:1",
            "tdrdzv1 join run=a addr=b pid=1 token=0 nproc=1 ports=12 nnodes=1:1",
            "tdrdzv1 close run=a addr=b pid=1 token=0 why=bored",
            "tdrdzv1 dance run=a addr=b pid=1 token=0",
            "tdrdzv1 poll run=a addr=b pid=1 token=0 novalue",
        ];
        for line in bad {
            assert!(decode_request(line).is_err(), "{line:?}");
        }
        for line in [
            "",
            "tdrdzv1 assigned round=1",
            "tdrdzv1 waiting round=x present=1",
            "tdrdzv1 closed round=1 why=finished",
        ] {
            assert!(decode_reply(line).is_err(), "{line:?}");
        }
        assert_eq!(
            decode_request("hello").unwrap_err(),
            "not a rendezvous message (it does not start with tdrdzv1)"
        );
    }

    /// A long failure text is cut to fit the line (at a character), and the line still
    /// decodes.
    #[test]
    fn long_texts_are_cut_to_the_line() {
        let e = Envelope {
            run_id: "r".into(),
            request: Request::Close {
                id: id(),
                why: CloseWhy::OutOfRestarts {
                    restarts: 1,
                    failure: "é%".repeat(MAX_LINE),
                },
            },
        };
        let line = encode_request(&e);
        assert!(line.len() <= MAX_LINE, "{}", line.len());
        let Ok(Envelope {
            request:
                Request::Close {
                    why: CloseWhy::OutOfRestarts { failure, .. },
                    ..
                },
            ..
        }) = decode_request(&line)
        else {
            panic!("{line}");
        };
        assert_eq!(failure.len(), MAX_TEXT - 1);
    }
}
