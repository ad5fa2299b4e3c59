//! `sluice serve --config FILE [--weights CKPT] [--listen ADDR] [--set k=v ...]`: one rollout
//! engine as an HTTP server (docs/runtime.md, "Rollout servers").
//!
//! The engine lives on a thread of its own ([`engine_thread`]); an axum server on a tokio
//! runtime parses requests, sends them to it through a channel and awaits the answers. The
//! first line on stdout is `listening on http://ADDR` (the default address is 127.0.0.1:0, a
//! port from the OS), so a caller that started the process reads its address there.
//!
//! - [`api`]: the token endpoints' JSON and the errors (a 4xx with `{"error": ...}`).
//! - [`commands`]: what the handlers send the engine thread and what it answers.
//! - [`engine_thread`]: sessions, turns, streaming, abort, weight installs, counters.
//! - [`openai`]: `/v1/completions` and `/v1/chat/completions` through the run's tokenizer.
//! - [`weights`]: `/weights` (a full checkpoint or a verified delta, by upload or by path).

pub mod api;
pub mod commands;
pub mod engine_thread;
pub mod lane;
pub mod openai;
pub mod weights;

use crate::config::{self, ConfigError, TrainConfig};
use crate::tasks::text::TextTokenizer;
use crate::train_cmd::TrainError;
use api::{ApiError, GenerateBody, StreamLine, TurnResult};
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use commands::{Command, Reply, TurnInput, TurnRequest};
use engine_thread::EngineThread;
use sluice_kernels::Backend;
use sluice_model::{Model, ModelConfig};
use sluice_runtime::engine::{Engine, EngineConfig};
use sluice_runtime::trajectory::{SamplingParams, WeightVersion};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// The options of `sluice serve`.
#[derive(Clone, Debug, Default)]
pub struct ServeOptions {
    pub config: Option<PathBuf>,
    pub sets: Vec<String>,
    /// A checkpoint (safetensors) to serve; default: the config's model freshly initialised.
    pub weights: Option<PathBuf>,
    /// The version the starting weights are served as.
    pub weights_version: u64,
    /// host:port; default 127.0.0.1:0.
    pub listen: Option<String>,
}

/// What a server runs: the config, tokenizer, model and engine settings. The bench builds
/// its in-process engine from the same.
pub struct Served {
    pub cfg: TrainConfig,
    pub tok: Arc<TextTokenizer>,
    pub model: Model,
    pub version: WeightVersion,
    pub engine_config: EngineConfig,
    /// A new session's sampling: `[rollout]` temperature, top_k, top_p, max_new_tokens and
    /// `run.seed`.
    pub defaults: SamplingParams,
}

fn config_error(key: &str, message: impl Into<String>) -> TrainError {
    TrainError::Config(ConfigError {
        key: key.into(),
        message: message.into(),
    })
}

/// Loads the config, the tokenizer and the weights (a bad one is exit 2, named).
pub fn prepare(o: &ServeOptions) -> Result<Served, TrainError> {
    let cfg = config::load(o.config.as_deref(), &o.sets)?;
    let tok = cfg.tokenizer.load()?;
    let backend =
        Backend::open(cfg.run.device).map_err(|e| config_error("run.device", e.to_string()))?;
    let mut model = match &o.weights {
        Some(path) => Model::from_checkpoint(path, &backend)
            .map_err(|e| TrainError::Input(format!("--weights {}: {e}", path.display())))?,
        None => {
            let mut mc = ModelConfig::from_file(&cfg.model.config).map_err(|e| {
                config_error(
                    "model.config",
                    format!("{}: {e}", cfg.model.config.display()),
                )
            })?;
            mc.vocab = cfg.tokenizer.model_vocab(&tok, mc.vocab);
            Model::new(mc, &backend).map_err(|e| TrainError::Run(e.to_string()))?
        }
    };
    if tok.vocab_size() > model.config.vocab {
        return Err(config_error(
            "tokenizer.path",
            format!(
                "tokenizer {} has {} ids, more than the model's vocabulary of {}: a model and \
                 its tokenizer must match",
                tok.version(),
                tok.vocab_size(),
                model.config.vocab
            ),
        ));
    }
    model
        .set_precision(&backend, cfg.model.precision)
        .map_err(|e| TrainError::Run(e.to_string()))?;
    let r = &cfg.rollout;
    let engine_config = EngineConfig {
        kv_bytes: r.kv_bytes,
        block_size: r.block_size,
        max_batch_tokens: r.max_batch_tokens,
        max_seqs: r.max_seqs,
        preempt: r.preempt,
        swap: r.swap,
        precision: cfg.model.precision,
    };
    let defaults = SamplingParams {
        temperature: r.temperature,
        top_k: r.top_k,
        top_p: r.top_p,
        max_new_tokens: r.max_new_tokens,
        seed: cfg.run.seed,
    };
    Ok(Served {
        version: WeightVersion(o.weights_version),
        cfg,
        tok,
        model,
        engine_config,
        defaults,
    })
}

impl Served {
    /// A new engine on these weights (on a fresh backend of `run.device`).
    pub fn engine(&self) -> Result<Engine, TrainError> {
        let backend = Backend::open(self.cfg.run.device)
            .map_err(|e| config_error("run.device", e.to_string()))?;
        Engine::new(
            backend,
            &self.model.config,
            self.model.compute_weights(),
            self.version,
            self.engine_config.clone(),
        )
        .map_err(|e| config_error("rollout", e.to_string()))
    }
}

/// What every handler shares.
pub struct AppState {
    tx: Sender<Command>,
    pub tok: Arc<TextTokenizer>,
    /// The `model` of OpenAI answers: the model config's file name.
    pub model_name: String,
    /// Requests the HTTP side refused before they reached the engine thread.
    rejected: AtomicU64,
}

impl AppState {
    fn send(&self, c: Command) -> Result<(), ApiError> {
        self.tx
            .send(c)
            .map_err(|_| ApiError::internal("the engine thread has stopped"))
    }

    /// Runs one turn to its end.
    pub async fn turn(&self, req: TurnRequest) -> Result<TurnResult, ApiError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Turn(req, Reply::Once(tx)))?;
        rx.await
            .map_err(|_| ApiError::internal("the engine thread dropped the request"))?
    }

    /// An error answer; a 4xx is counted.
    pub fn reject(&self, e: ApiError) -> Response {
        if e.is_client_error() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
        }
        e.into_response()
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, ApiError> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx))?;
        rx.await
            .map_err(|_| ApiError::internal("the engine thread dropped the request"))
    }
}

/// The most bytes of a JSON request (a prompt of a million ids fits).
pub const MAX_JSON_BODY: usize = 16 << 20;

/// A JSON endpoint's body, read whole; a larger one is a 413 with a JSON error (counted).
pub struct JsonBody(pub Bytes);

impl axum::extract::FromRequest<Arc<AppState>> for JsonBody {
    type Rejection = Response;

    async fn from_request(
        req: axum::extract::Request,
        state: &Arc<AppState>,
    ) -> Result<Self, Self::Rejection> {
        let path = req.uri().path().to_string();
        // Refused from its Content-Length at once, before any of it is read.
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if let Some(n) = declared.filter(|&n| n > MAX_JSON_BODY as u64) {
            return Err(state.reject(ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                message: format!(
                    "{path}: a body of {n} bytes is over the limit: it must fit within \
                     {MAX_JSON_BODY} bytes"
                ),
            }));
        }
        match axum::body::to_bytes(req.into_body(), MAX_JSON_BODY).await {
            Ok(b) => Ok(JsonBody(b)),
            Err(e) => Err(state.reject(ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                message: format!(
                    "{path}: the body could not be read whole within {MAX_JSON_BODY} bytes: {e}"
                ),
            })),
        }
    }
}

async fn generate(State(state): State<Arc<AppState>>, JsonBody(body): JsonBody) -> Response {
    let b: GenerateBody = match api::parse_body("/generate", &body) {
        Ok(b) => b,
        Err(e) => return state.reject(e),
    };
    let req = TurnRequest {
        endpoint: "/generate",
        session_id: b.session_id.clone(),
        input: TurnInput::Tokens(b.prompt.clone()),
        max_new_tokens: b.max_new_tokens,
        sampling: b.sampling,
        stop: b.stop_config(),
    };
    if !b.stream {
        return match state.turn(req).await {
            Ok(r) => Json(r).into_response(),
            Err(e) => state.reject(e),
        };
    }
    let (started, accepted) = oneshot::channel();
    let (lines, rx) = mpsc::unbounded_channel::<StreamLine>();
    if let Err(e) = state.send(Command::Turn(req, Reply::Stream { started, lines })) {
        return state.reject(e);
    }
    match accepted.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return state.reject(e),
        Err(_) => return state.reject(ApiError::internal("the engine thread dropped the request")),
    }
    // One JSON object per line; the stream ends after the line with the finish reason.
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        let line = rx.recv().await?;
        let mut text = serde_json::to_vec(&line).unwrap_or_default();
        text.push(b'\n');
        Some((Ok::<Bytes, std::convert::Infallible>(Bytes::from(text)), rx))
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn abort(State(state): State<Arc<AppState>>, JsonBody(body): JsonBody) -> Response {
    let b: api::AbortBody = match api::parse_body("/abort", &body) {
        Ok(b) => b,
        Err(e) => return state.reject(e),
    };
    match state.ask(|tx| Command::Abort(b.session_id, tx)).await {
        Ok(Ok(a)) => Json(a).into_response(),
        Ok(Err(e)) | Err(e) => state.reject(e),
    }
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.ask(Command::Health).await {
        Ok(mut h) => {
            h.counters.rejected += state.rejected.load(Ordering::Relaxed);
            Json(h).into_response()
        }
        Err(e) => e.into_response(),
    }
}

async fn version(State(state): State<Arc<AppState>>) -> Response {
    match state.ask(Command::Health).await {
        Ok(h) => {
            Json(serde_json::json!({ "version": h.version, "blake3": h.blake3 })).into_response()
        }
        Err(e) => e.into_response(),
    }
}

async fn lane_join(
    State(state): State<Arc<AppState>>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    let image = match lane::parse_query("/lane/join", query.as_deref()) {
        Ok((Some(v), Some(hash))) => lane::JoinImage {
            bytes: body.to_vec(),
            version: WeightVersion(v),
            hash,
        },
        Ok(_) => {
            return state.reject(ApiError::bad_request(
                "/lane/join: give the image's version=N and blake3=HEX in the query",
            ))
        }
        Err(e) => return state.reject(e),
    };
    match state.ask(|tx| Command::LaneJoin(image, tx)).await {
        Ok(Ok(a)) => Json(a).into_response(),
        Ok(Err(e)) | Err(e) => state.reject(e),
    }
}

async fn lane_step(State(state): State<Arc<AppState>>, JsonBody(body): JsonBody) -> Response {
    let req = match api::parse_body("/lane/step", &body) {
        Ok(r) => r,
        Err(e) => return state.reject(e),
    };
    match state.ask(|tx| Command::LaneStep(req, tx)).await {
        Ok(Ok(a)) => Json(a).into_response(),
        Ok(Err(e)) | Err(e) => state.reject(e),
    }
}

async fn install_weights(
    State(state): State<Arc<AppState>>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let update = lane::parse_query("/weights", query.as_deref())
        .and_then(|(v, hash)| weights::parse_update(body.to_vec(), json, v, hash));
    let update = match update {
        Ok(u) => u,
        Err(e) => return state.reject(e),
    };
    match state.ask(|tx| Command::Weights(update, tx)).await {
        Ok(Ok(i)) => Json(serde_json::json!({
            "version": i.version.0,
            "blake3": i.hash.to_hex(),
            "delta": i.delta,
        }))
        .into_response(),
        Ok(Err(e)) | Err(e) => state.reject(e),
    }
}

async fn not_found(State(state): State<Arc<AppState>>, uri: axum::http::Uri) -> Response {
    state.reject(ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "no endpoint {}; see docs/runtime.md, \"Rollout servers\"",
            uri.path()
        ),
    })
}

async fn wrong_method(
    State(state): State<Arc<AppState>>,
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> Response {
    state.reject(ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!(
            "{} does not take {method}: /health and /version are GET, the others POST",
            uri.path()
        ),
    })
}

/// The routes (every request body is read whole: the engine needs all of it).
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/generate", post(generate))
        .route("/abort", post(abort))
        .route("/health", get(health))
        .route("/version", get(version))
        // A checkpoint upload is as large as the model.
        .route(
            "/weights",
            post(install_weights).layer(DefaultBodyLimit::disable()),
        )
        // A join carries the whole image.
        .route(
            "/lane/join",
            post(lane_join).layer(DefaultBodyLimit::disable()),
        )
        .route("/lane/step", post(lane_step))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .with_state(state)
}

/// Runs the server until the process is stopped. The first stdout line is the address.
pub fn run(o: &ServeOptions, out: &mut dyn Write) -> Result<(), TrainError> {
    let served = prepare(o)?;
    let engine = served.engine()?;
    let held = weights::HeldImage::of(served.model.compute_weights(), served.version)
        .map_err(TrainError::Run)?;
    let listen = o.listen.as_deref().unwrap_or("127.0.0.1:0");
    let listener = std::net::TcpListener::bind(listen)
        .map_err(|e| TrainError::Input(format!("--listen {listen}: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| TrainError::Run(e.to_string()))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| TrainError::Run(e.to_string()))?;
    let (tx, rx) = std::sync::mpsc::channel();
    let exit_after = match std::env::var(lane::EXIT_AFTER_ENV) {
        Ok(v) => Some(v.parse::<u64>().map_err(|_| {
            TrainError::Input(format!(
                "{}={v:?}: not a non-negative integer (a test hook)",
                lane::EXIT_AFTER_ENV
            ))
        })?),
        Err(_) => None,
    };
    let thread = EngineThread::new(
        engine,
        served.tok.clone(),
        served.defaults,
        held,
        lane::LaneState::new(exit_after),
    );
    std::thread::Builder::new()
        .name("sluice-serve-engine".into())
        .spawn(move || thread.run(rx))
        .map_err(|e| TrainError::Run(format!("cannot start the engine thread: {e}")))?;
    let state = Arc::new(AppState {
        tx,
        tok: served.tok.clone(),
        model_name: served
            .cfg
            .model
            .config
            .file_stem()
            .map_or("sluice".into(), |s| s.to_string_lossy().into_owned()),
        rejected: AtomicU64::new(0),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_io()
        .build()
        .map_err(|e| TrainError::Run(format!("cannot start the HTTP runtime: {e}")))?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|e| TrainError::Run(e.to_string()))?;
        // The first line: callers read the address here.
        let _ = writeln!(out, "listening on http://{addr}");
        let _ = out.flush();
        eprintln!(
            "sluice serve: {} at version {}, {} on {}, tokenizer {}",
            served.cfg.model.config.display(),
            served.version,
            served.cfg.model.precision,
            served.cfg.run.device,
            served.tok.version()
        );
        axum::serve(listener, router(state))
            .await
            .map_err(|e| TrainError::Run(format!("the HTTP server stopped: {e}")))
    })
}
