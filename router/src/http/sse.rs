//! Server-sent events in the OpenAI style: each chunk is one `data: {json}` event, the stream
//! ends with `data: [DONE]`, and a generation that fails after the response began ends the
//! stream with an error object (then `[DONE]`).

use std::convert::Infallible;

use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, BoxStream, StreamExt};

use super::generation::ChoiceEvent;

/// Turns choice events into the JSON chunks of one endpoint.
pub trait ChunkWriter: Send + 'static {
    /// Chunks sent before any generated text (chat's role deltas).
    fn start(&mut self) -> Vec<String>;
    /// Chunks for one event (possibly none). `Failed` never reaches the writer.
    fn on_event(&mut self, event: ChoiceEvent) -> Vec<String>;
    /// Chunks after every choice finished (the usage chunk).
    fn finish(&mut self) -> Vec<String>;
}

const DONE: &str = "[DONE]";
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(15);

struct Driver<W> {
    events: BoxStream<'static, ChoiceEvent>,
    writer: W,
    started: bool,
}

async fn next_chunks<W: ChunkWriter>(mut d: Driver<W>) -> Option<(Vec<String>, Option<Driver<W>>)> {
    if !d.started {
        d.started = true;
        return Some((d.writer.start(), Some(d)));
    }
    loop {
        match d.events.next().await {
            Some(ChoiceEvent::Failed(error)) => {
                // Dropping `d` here aborts the other choices of this response.
                let body = serde_json::to_string(&error.body()).expect("error bodies serialize");
                return Some((vec![body, DONE.to_owned()], None));
            }
            Some(event) => {
                let chunks = d.writer.on_event(event);
                if !chunks.is_empty() {
                    return Some((chunks, Some(d)));
                }
            }
            None => {
                let mut chunks = d.writer.finish();
                chunks.push(DONE.to_owned());
                return Some((chunks, None));
            }
        }
    }
}

pub fn sse_response<W: ChunkWriter>(
    events: BoxStream<'static, ChoiceEvent>,
    writer: W,
) -> Response {
    let driver = Driver {
        events,
        writer,
        started: false,
    };
    let chunks = stream::unfold(
        Some(driver),
        |driver| async move { next_chunks(driver?).await },
    )
    .flat_map(|chunks| {
        stream::iter(
            chunks
                .into_iter()
                .map(|data| Ok::<_, Infallible>(Event::default().data(data))),
        )
    });
    // Comment lines while a request waits in the queue or prefills keep proxies from closing
    // an idle connection; SSE clients ignore them.
    Sse::new(chunks)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE_INTERVAL))
        .into_response()
}

/// Serializes a chunk; our response types always serialize.
pub fn to_json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("response types serialize")
}
