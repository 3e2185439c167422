//! `turnstile migrate`: create the store's tables if they are missing.

use std::process::ExitCode;

use clap::Args;
use turnstile::ErrorKind;

use crate::{StoreArgs, fail};

#[derive(Args, Debug)]
pub(crate) struct MigrateArgs {
    #[command(flatten)]
    store: StoreArgs,
}

/// Creates the lock, fence and idempotency tables where the engine has them.
pub(crate) async fn run(args: MigrateArgs) -> ExitCode {
    let locker = match args.store.locker().await {
        Ok(locker) => locker,
        Err(error) => return fail(&error),
    };
    if let Err(error) = locker.backend().migrate().await {
        return fail(&error);
    }
    // The idempotency records' table too (opening the store creates it), where the
    // engine has one.
    let url = match args.store.url() {
        Ok(url) => url,
        Err(error) => return fail(&error),
    };
    match turnstile::store::connect_idempotency(&url).await {
        Ok(_) => {}
        Err(error) if error.kind() == ErrorKind::UnsupportedStore => {}
        Err(error) => return fail(&error),
    }
    println!("{}: tables ready", locker.backend().describe());
    ExitCode::SUCCESS
}
